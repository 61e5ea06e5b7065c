"""``gpuwise bench`` on the CPU: output modes, JSON keys, save/compare, calibration, roofline, bad input."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

FAST = ["bench", "--quick", "--ops", "gemm,copy", "--dtype", "fp32", "--device", "cpu"]


run = run_cli


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


def test_calibration_is_only_for_catalog_gpus(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code, _, err = run(capsys, *FAST, "--calibrate")
    assert code == 0 and "calibration not stored: plans are for catalog GPUs and cpu matches none" in err
    assert not (tmp_path / "gpuwise").exists()


def test_calibration_keeps_the_best_rates_and_merges_devices(tmp_path):
    from gpuwise.bench.results import calibration_from_results
    from gpuwise.bench.suite import BenchResult
    from gpuwise.hardware.calibration import Calibration, load_calibrations, save_calibration

    def row(op, dtype, tflops=None, gbps=None):
        return BenchResult(op=op, dtype=dtype, shape="s", device="cuda:0", median_s=1.0, p10_s=1.0, p90_s=1.0,
                           repeats=3, flops=None, bytes=None, tflops=tflops, gbps=gbps, peak_memory_bytes=None,
                           pct_of_peak=None, speedup_vs_cpu=None)

    rows = [row("gemm", "bf16", 500.0), row("gemm", "bf16", 700.0), row("gemm", "fp32", 50.0),
            row("copy", "fp32", gbps=3000.0), row("copy", "fp32", gbps=4000.0), row("conv2d", "bf16", 900.0)]
    cal = calibration_from_results("h200", rows)
    assert cal.tflops == {"bf16": 700.0, "fp32": 50.0} and cal.gbps == 4000.0  # best GEMM per dtype, best copy
    save_calibration(cal, tmp_path)
    save_calibration(Calibration(device="a100-80gb-sxm", tflops={"bf16": 250.0}, gbps=None), tmp_path)
    assert set(load_calibrations(tmp_path)) == {"h200", "a100-80gb-sxm"}


def test_every_gpu_case_has_a_dtype_it_can_build():
    """Even when only fp8 GEMMs are asked for, the other ops pick a 16-bit dtype (torch has no fp8 SDPA)."""
    import torch

    from gpuwise.bench.suite import OPS, cases

    for dtypes in (("fp8",), ("fp32",), ("tf32", "fp16")):
        for case in cases(torch.device("cuda"), quick=False, ops=OPS, dtypes=dtypes):
            if case.op != "gemm":
                assert case.dtype in ("fp32", "fp16", "bf16", "bf16-mixed"), (case.op, case.dtype)


@pytest.mark.parametrize(("args", "message"), [
    (["--ops", "gemm,fft"], "--ops 'gemm,fft': fft not one of"),
    (["--dtype", "int4"], "--dtype 'int4': int4 not one of"),
    (["--device", "xla"], "not a device gpuwise can time"),
    (["--plot", "r.svg"], "the picture is a PNG"),
    (["--compare", "missing.json"], "no such file: missing.json"),
    (["--calibrate", "--ops", "gemm"], "--calibrate stores GEMM and copy rates"),
    (["--device", "foo"], "--device 'foo' is not a device name"),
    (["--device", "cuda:x"], "--device 'cuda:x' is not a device name"),
    (["--ops", "h2d", "--device", "cpu"], "nothing of --ops h2d runs on cpu"),
    (["--compare", "{dir}"], "is a folder"),
    (["--compare", "{file}", "--compare", "{file}"], "two --compare files run nothing, so --quick"),
    (["--compare", "{file}", "--json"], "--json prints this run's results"),
    (["--save", "{dir}"], "cannot write"),
])
def test_bad_input(capsys, tmp_path, args, message):
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"results": []}))
    args = [a.replace("{dir}", str(tmp_path)).replace("{file}", str(saved)) for a in args]
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
