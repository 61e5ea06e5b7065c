"""gpuwise: measured answers to GPU questions for deep-learning practitioners."""

__version__ = "0.1.0"
