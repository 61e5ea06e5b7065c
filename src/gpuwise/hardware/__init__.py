"""Hardware facts: the sourced accelerator catalog and what this machine has."""

from gpuwise.hardware.catalog import DTYPES, SEGMENTS, Accelerator, Catalog, PeakRates, load_catalog

__all__ = ["DTYPES", "SEGMENTS", "Accelerator", "Catalog", "PeakRates", "load_catalog"]
