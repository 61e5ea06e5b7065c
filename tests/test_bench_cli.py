"""``gpuwise bench`` on the CPU: output modes, JSON keys, save/compare, calibration, roofline, bad input."""

from __future__ import annotations

import json

import pytest

from gpuwise import cli

FAST = ["bench", "--quick", "--ops", "gemm,copy", "--dtype", "fp32", "--device", "cpu"]


def run(capsys, *args):
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_json_has_the_documented_keys(capsys):
    code, out, err = run(capsys, *FAST, "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert {r["op"] for r in rows} == {"gemm", "copy"}
    for r in rows:
        assert {"op", "dtype", "shape", "device", "median_s", "tflops", "gbps", "peak_memory_bytes"} <= set(r)
        assert r["median_s"] > 0 and r["device"] == "cpu"
    gemm = next(r for r in rows if r["op"] == "gemm" and r["shape"].startswith("1024x"))
    assert gemm["flops"] == 2 * 1024**3
    assert gemm["tflops"] == pytest.approx(gemm["flops"] / gemm["median_s"] / 1e12)
    copy = next(r for r in rows if r["op"] == "copy")
    import torch

    from gpuwise.bench.suite import cache_bytes

    size = max(64 * 2**20, 2 * cache_bytes(torch.device("cpu")))  # beyond the last-level cache
    assert copy["shape"] == f"{size // 2**20} MiB" and copy["bytes"] == 2 * size  # read + write
    assert copy["gbps"] == pytest.approx(copy["bytes"] / copy["median_s"] / 1e9)


def test_table_save_compare_and_plot(capsys, tmp_path):
    saved, png = tmp_path / "run.json", tmp_path / "roof.png"
    code, out, err = run(capsys, *FAST, "--save", str(saved), "--plot", str(png))
    assert code == 0, err
    assert "gemm" in out and "roofline drawn" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(saved.read_text())["results"]
    code, out, _ = run(capsys, "bench", "--compare", str(saved), "--compare", str(saved), "--json")
    pairs = json.loads(out)
    assert code == 0 and len(pairs) == 4 and all(p["speedup"] == 1.0 for p in pairs)


def test_calibration_is_stored_in_the_cache_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code, out, err = run(capsys, *FAST, "--calibrate")
    assert code == 0, err
    assert "calibration for cpu stored" in out
    data = json.loads((tmp_path / "gpuwise" / "calibration.json").read_text())
    assert data["cpu"]["tflops"]["fp32"] > 0 and data["cpu"]["gbps"] > 0


@pytest.mark.parametrize(("args", "message"), [
    (["--ops", "gemm,fft"], "--ops 'gemm,fft': fft not one of"),
    (["--dtype", "int4"], "--dtype 'int4': int4 not one of"),
    (["--device", "xla"], "not a device gpuwise can time"),
    (["--plot", "r.svg"], "the picture is a PNG"),
    (["--compare", "missing.json"], "no such file: missing.json"),
    (["--calibrate", "--ops", "gemm"], "--calibrate stores GEMM and copy rates"),
])
def test_bad_input(capsys, args, message):
    code, _, err = run(capsys, "bench", "--quick", *args)
    assert code == 2 and message in err and err.count("\n") == 1


def test_plans_use_calibrated_rates_and_say_so(capsys, tmp_path, monkeypatch):
    from gpuwise.hardware.catalog import load_catalog

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    args = ["plan", "--model", "gpt2", "--seq", "128", "--gpu", "h100", "--json"]
    code, out, _ = run(capsys, *args)
    before = json.loads(out)
    h100 = load_catalog().get("h100-sxm")
    fit = before["gpus"][0]
    assert fit["rates"] == "datasheet"
    assert fit["step_time_s"] == pytest.approx(max(before["flops_per_step"] / (h100.peak_tflops.bf16 * 1e12),
                                                   before["bytes_per_step"] / (h100.memory_bandwidth_gbps * 1e9)))
    folder = tmp_path / "gpuwise"
    folder.mkdir()
    (folder / "calibration.json").write_text(json.dumps(
        {"h100-sxm": {"device": "h100-sxm", "tflops": {"bf16": 10.0}, "gbps": 100.0}}))
    code, out, _ = run(capsys, *args)
    fit = json.loads(out)["gpus"][0]
    assert code == 0 and fit["rates"] == "measured"
    assert fit["step_time_s"] == pytest.approx(max(before["flops_per_step"] / 10e12, before["bytes_per_step"] / 100e9))
    code, out, _ = run(capsys, *args[:-1])
    assert "h100-sxm)" in out and "--calibrate measured" in out
