"""Honest measurements: ``measure`` for your own code, and the benchmark suite behind ``gpuwise bench``."""

from gpuwise.bench.measure import Measurement, measure

__all__ = ["Measurement", "measure"]
