"""Stand-ins the tests build on: hand-made environments (``environments``), a fake NVML (``nvml``), a fake GPU
timer (``timer``). Importable as ``fakes.*`` (pyproject puts tests/ on the path)."""
