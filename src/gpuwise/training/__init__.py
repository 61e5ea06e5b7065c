"""Training: checkpoints now; the Trainer and ``gpuwise train`` build on them (issue 5)."""
