"""What a captured step costs in time on a GPU: ``step`` for a training or inference step (the one ``StepTime``),
``roofline`` for the bound it carries, ``serving`` for decode under load."""
