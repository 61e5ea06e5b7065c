"""Rates measured on this machine's GPUs (``gpuwise bench --calibrate``), stored for later plans.

They live in the user data folder (``data_dir``: $XDG_DATA_HOME/gpuwise, else platformdirs' folder for the OS), not
in a cache a cleaner may wipe. Calibrations stored by earlier versions in ``cache_dir`` are still read (the new folder
wins per device); nothing is written there any more.

>>> cal = Calibration(device="h100-sxm", tflops={"bf16": 720.0}, gbps=2900.0)
>>> # save_calibration(cal, data_dir(os.environ)); stored_calibrations(os.environ)["h100-sxm"]
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import platformdirs

from gpuwise.errors import GpuwiseError
from gpuwise.files import atomic_path, load_json

FILE_NAME = "calibration.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """Rates measured on one device: the best GEMM TFLOPS per element type and the best copy bandwidth."""

    device: str  # catalog key when the device is in the catalog, else its name
    tflops: dict[str, float]  # by the catalog's rate key: fp32, tf32, fp16, bf16, fp8
    gbps: float | None  # device-to-device copy, read + write, in 10^9 bytes per second

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not isinstance(self.tflops, dict) or not all(
                isinstance(v, (int, float)) and v > 0 for v in self.tflops.values()):
            raise ValueError(f"not a calibration: {self.device!r}, {self.tflops!r}")
        if self.gbps is not None and not (isinstance(self.gbps, (int, float)) and self.gbps > 0):
            raise ValueError(f"not a bandwidth: {self.gbps!r}")


def data_dir(environ: Mapping[str, str]) -> Path:
    """Where calibrations live: $XDG_DATA_HOME/gpuwise when ``environ`` sets it (on any OS), else the OS's user data
    folder (platformdirs: ~/.local/share/gpuwise, ~/Library/Application Support/gpuwise, %LOCALAPPDATA%\\gpuwise)."""
    if environ.get("XDG_DATA_HOME"):
        return Path(environ["XDG_DATA_HOME"]) / "gpuwise"
    return platformdirs.user_data_path("gpuwise", appauthor=False)


def cache_dir(environ: Mapping[str, str]) -> Path:
    """gpuwise's cache (captures): $XDG_CACHE_HOME/gpuwise, else ~/.cache/gpuwise. Calibrations lived here before
    ``data_dir``; ``stored_calibrations`` still reads them."""
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME", "~")).expanduser() / ".cache")
    return Path(base) / "gpuwise"


def save_calibration(cal: Calibration, folder: Path) -> Path:
    """Add (or replace) ``cal`` in the folder's calibration file, written atomically; its path. A cache that
    cannot be written (a file where the folder goes, a full disk) is a one-line error naming it."""
    path = folder / FILE_NAME
    try:
        folder.mkdir(parents=True, exist_ok=True)
        existing = load_calibrations(folder)
        existing[cal.device] = cal
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps({k: dataclasses.asdict(v) for k, v in existing.items()}, indent=2))
    except (OSError, GpuwiseError) as exc:
        why = exc.message if isinstance(exc, GpuwiseError) else exc.strerror or str(exc)
        raise GpuwiseError(f"cannot store the calibration in {path}: {why}",
                           "set XDG_DATA_HOME to a folder you can write to, or drop --calibrate") from exc
    return path


def load_calibrations(folder: Path) -> dict[str, Calibration]:
    """Every stored calibration by device; a missing or damaged file is no calibration (plans use datasheets)."""
    try:
        data = load_json((folder / FILE_NAME).read_text())
        return {k: Calibration(**v) for k, v in data.items()}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError, AttributeError, ValueError):
        return {}


def stored_calibrations(environ: Mapping[str, str]) -> dict[str, Calibration]:
    """Every calibration ``gpuwise bench --calibrate`` stored: the data folder's, and for other devices the ones an
    earlier version kept in the cache folder (read only, so an upgrade loses none)."""
    return {**load_calibrations(cache_dir(environ)), **load_calibrations(data_dir(environ))}
