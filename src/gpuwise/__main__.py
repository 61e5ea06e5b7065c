"""``python -m gpuwise``."""

from gpuwise.cli import run

run()
