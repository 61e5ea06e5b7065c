"""Training: the loop (trainer.py), its config and data, crash-safe checkpoints, torchrun ranks."""
