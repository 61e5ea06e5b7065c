"""What a captured step costs in time on a GPU: ``step`` for a training or inference step (and its roofline bound),
``serving`` for decode under load."""
