"""hardware/calibration.py: calibrations live in the user data folder; ones an earlier version kept in the cache are
still read, never written."""

from __future__ import annotations

import json

import platformdirs

from gpuwise.hardware.calibration import (
    Calibration,
    cache_dir,
    data_dir,
    load_calibrations,
    save_calibration,
    stored_calibrations,
)

H100 = Calibration(device="h100-sxm", tflops={"bf16": 700.0}, gbps=3000.0)
A100 = Calibration(device="a100-80gb-sxm", tflops={"bf16": 250.0}, gbps=None)


def _environ(tmp_path) -> dict[str, str]:
    return {"XDG_DATA_HOME": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "HOME": str(tmp_path / "home")}


def test_the_data_folder_follows_xdg_data_home_else_platformdirs(tmp_path):
    assert data_dir(_environ(tmp_path)) == tmp_path / "data" / "gpuwise"
    assert data_dir({}) == platformdirs.user_data_path("gpuwise", appauthor=False)
    assert cache_dir(_environ(tmp_path)) == tmp_path / "cache" / "gpuwise"


def test_a_saved_calibration_loads_back_from_the_data_folder_only(tmp_path):
    environ = _environ(tmp_path)
    path = save_calibration(H100, data_dir(environ))
    assert path == tmp_path / "data" / "gpuwise" / "calibration.json"
    assert stored_calibrations(environ) == {"h100-sxm": H100}
    assert json.loads(path.read_text())["h100-sxm"] == {"device": "h100-sxm", "tflops": {"bf16": 700.0},
                                                        "gbps": 3000.0}
    assert not (tmp_path / "cache").exists()


def test_a_calibration_in_the_old_cache_folder_is_still_read_and_left_as_it_was(tmp_path):
    environ = _environ(tmp_path)
    old = cache_dir(environ) / "calibration.json"
    old.parent.mkdir(parents=True)
    stale = Calibration(device="h100-sxm", tflops={"bf16": 600.0}, gbps=None)
    old.write_text(json.dumps({"a100-80gb-sxm": {"device": "a100-80gb-sxm", "tflops": {"bf16": 250.0}, "gbps": None},
                               "h100-sxm": {"device": "h100-sxm", "tflops": {"bf16": 600.0}, "gbps": None}}))
    before = old.read_text()
    assert stored_calibrations(environ) == {"a100-80gb-sxm": A100, "h100-sxm": stale}  # no data folder yet
    save_calibration(H100, data_dir(environ))
    assert stored_calibrations(environ) == {"a100-80gb-sxm": A100, "h100-sxm": H100}  # the new one wins its device
    assert old.read_text() == before and set(load_calibrations(data_dir(environ))) == {"h100-sxm"}
