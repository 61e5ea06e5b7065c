"""``gpuwise bench`` on the CPU: output modes, JSON keys, save/compare, calibration, roofline, bad input."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

FAST = ["bench", "--quick", "--ops", "gemm,copy", "--dtype", "fp32", "--device", "cpu"]


run = run_cli
_MEASURED: dict = {}


@pytest.fixture
def fast_json(capsys) -> dict:
    """What ``FAST --json`` prints, measured by the first test that asks and read by the others (each run measures
    for seconds; what they check of it does not depend on which run it was)."""
    if not _MEASURED:
        code, out, err = run(capsys, *FAST, "--json")
        assert code == 0, err
        _MEASURED.update(json.loads(out))
    return _MEASURED


def test_bench_json_has_the_documented_keys(fast_json):
    rows = fast_json["results"]
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
    pairs = json.loads(out)["pairs"]
    assert code == 0 and len(pairs) == 4 and all(p["speedup"] == 1.0 for p in pairs)


def test_calibration_is_only_for_catalog_gpus(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
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
    (["--plot", "r.jpg"], "the picture is a PNG"),
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

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the file below is where earlier versions kept it
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # empty: the old one is still read
    args = ["plan", "--model", "gpt2", "--seq", "128", "--gpu", "h100", "--json"]
    code, out, _ = run(capsys, *args)
    before = json.loads(out)
    h100 = load_catalog().get("h100-sxm")
    fit = before["gpus"][0]
    assert fit["rates"] == "datasheet"
    assert fit["step_time_bound_s"] == pytest.approx(max(before["flops_per_step"] / (h100.peak_tflops.bf16 * 1e12),
                                                   before["bytes_per_step"] / (h100.memory_bandwidth_gbps * 1e9)))
    folder = tmp_path / "gpuwise"
    folder.mkdir(exist_ok=True)  # the capture cache may have made it
    (folder / "calibration.json").write_text(json.dumps(
        {"h100-sxm": {"device": "h100-sxm", "tflops": {"bf16": 10.0}, "gbps": 100.0}}))
    code, out, _ = run(capsys, *args)
    fit = json.loads(out)["gpus"][0]
    assert code == 0 and fit["rates"] == "measured"
    assert fit["step_time_bound_s"] == pytest.approx(max(before["flops_per_step"] / 10e12,
                                                         before["bytes_per_step"] / 100e9))
    code, out, _ = run(capsys, *args[:-1])
    out = " ".join(out.split())  # the footnote wraps at the terminal's width
    assert "h100-sxm)" in out and "--calibrate measured" in out


# --- the device's catalog row ----------------------------------------------------------------------------


def _two_gpu_machine():
    """GPU 0 an H100, GPU 1 an A100 80GB, as ``describe_local`` sees them through NVML and torch."""
    from dataclasses import replace

    from conftest import cuda_env, gpu, nvml
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.hardware.detect import describe_local

    h100, a100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
    env = cuda_env(count=2)
    env = replace(env, torch=replace(env.torch, devices=(gpu(h100, (9, 0), index=0), gpu(a100, (8, 0), index=1))),
                  nvml_devices=(nvml(h100, (9, 0), index=0), nvml(a100, (8, 0), index=1)))
    return describe_local(env, load_catalog())


def test_cuda_1_uses_gpu_1s_catalog_row(capsys, tmp_path, monkeypatch):
    """``bench --device cuda:1`` on an H100 + A100 machine: pct_of_peak, the roofline's ceilings and
    --calibrate all use the A100's row. Only the torch side is stubbed (no CUDA here): the timing handle and
    the timer, which reports 1 ms per call; the device resolution and run_bench are the real ones."""
    from gpuwise.bench import suite
    from gpuwise.bench.measure import Measurement
    from gpuwise.hardware import device as devices
    from gpuwise.hardware.calibration import load_calibrations
    from gpuwise.hardware.catalog import load_catalog

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(devices, "local_machine", lambda environ: _two_gpu_machine())
    handles = []
    monkeypatch.setattr(suite, "device_for", lambda name: handles.append(name) or devices.CpuDevice(name=name))

    def timed(case, dev, *, warmup, repeats):
        flops = 2.0 * case.dims["m"] * case.dims["n"] * case.dims["k"] if case.op == "gemm" else None
        m = Measurement(name=case.op, device=dev.name, warmup=warmup, repeats=repeats, times_s=(1e-3,) * repeats,
                        median_s=1e-3, p10_s=1e-3, p90_s=1e-3, peak_memory_bytes=None, flops=flops, bytes=case.bytes)
        return m, flops, case.bytes

    monkeypatch.setattr(suite, "run_case", timed)
    drawn = {}
    monkeypatch.setattr("gpuwise.plot.plot_roofline", lambda results, path, **kw: drawn.update(kw))
    code, out, err = run(capsys, "bench", "--device", "cuda:1", "--quick", "--ops", "gemm,copy", "--dtype", "bf16",
                         "--calibrate", "--plot", str(tmp_path / "roof.png"), "--json")
    assert code == 0, err
    assert handles[0] == "cuda:1"
    a100, h100 = load_catalog().get("a100-80gb-sxm"), load_catalog().get("h100-sxm")
    rows = json.loads(out)["results"]
    gemm = next(r for r in rows if r["op"] == "gemm" and r["dims"] == {"m": 2048, "n": 2048, "k": 2048})
    assert gemm["device"] == "cuda:1" and gemm["tflops"] == pytest.approx(2 * 2048**3 / 1e-3 / 1e12)
    assert gemm["pct_of_peak"] == pytest.approx(100 * gemm["tflops"] / a100.peak_tflops.bf16)  # not the H100's
    assert gemm["pct_of_peak"] != pytest.approx(100 * gemm["tflops"] / h100.peak_tflops.bf16)
    copy = next(r for r in rows if r["op"] == "copy")
    assert copy["pct_of_peak"] == pytest.approx(100 * copy["bytes"] / 1e-3 / 1e9 / a100.memory_bandwidth_gbps)
    assert drawn["ceilings"] == {"bf16": a100.peak_tflops.bf16} and drawn["peak_gbps"] == a100.memory_bandwidth_gbps
    assert drawn["title"].startswith("cuda:1 (NVIDIA A100-SXM4-80GB)")
    cal = load_calibrations(tmp_path / "gpuwise")
    assert set(cal) == {"a100-80gb-sxm"} and cal["a100-80gb-sxm"].tflops["bf16"] == pytest.approx(gemm["tflops"])
    code, out, err = run(capsys, "bench", "--device", "cuda", "--quick", "--ops", "gemm", "--dtype", "bf16", "--json")
    assert code == 0 and json.loads(out)["results"][0]["pct_of_peak"] == pytest.approx(
        100 * json.loads(out)["results"][0]["tflops"] / h100.peak_tflops.bf16)  # the default GPU is GPU 0, the H100
    code, _, err = run(capsys, "bench", "--device", "cuda:2", "--quick")
    assert code == 2 and "there are 2 CUDA GPUs" in err


# --- numbers, not strings ---------------------------------------------------------------------------------


def test_cases_carry_their_sizes_and_least_bytes_as_numbers():
    """A GEMM's bytes are A and B read once and C written once, from the element widths (fp8 writes bf16)."""
    import torch

    from gpuwise.bench.suite import OPS, _gemm, cases

    assert _gemm(8192, 14336, 4096, "bf16").bytes == (8192 * 4096 + 4096 * 14336 + 8192 * 14336) * 2
    assert _gemm(64, 32, 16, "fp32").bytes == (64 * 16 + 16 * 32 + 64 * 32) * 4
    assert _gemm(64, 32, 16, "fp8").bytes == 64 * 16 + 16 * 32 + 64 * 32 * 2
    for case in cases(torch.device("cuda"), quick=False, ops=OPS, dtypes=("bf16", "fp8")):
        assert case.dims and all(isinstance(v, int) for v in case.dims.values()), case.op
        if case.op == "gemm":
            m, n, k = case.dims["m"], case.dims["n"], case.dims["k"]
            assert case.shape == f"{m}x{k} @ {k}x{n}"


def test_a_file_saved_before_dims_existed_still_compares(capsys, tmp_path, fast_json):
    """Files from the version before dims (a shape label and no dims, GEMM bytes null) load and compare."""
    rows = fast_json["results"]
    old = [{k: v for k, v in r.items() if k != "dims"} | ({"bytes": None} if r["op"] == "gemm" else {})
           for r in rows]
    (tmp_path / "old.json").write_text(json.dumps({"gpuwise_bench": 1, "machine": {"device": "cpu (old)"},
                                                   "results": old}))
    (tmp_path / "new.json").write_text(json.dumps({"gpuwise_bench": 1, "machine": {}, "results": rows}))
    code, out, err = run(capsys, "bench", "--compare", str(tmp_path / "old.json"), "--compare",
                         str(tmp_path / "new.json"), "--json")
    assert code == 0, err
    pairs = json.loads(out)["pairs"]
    assert len(pairs) == len(rows) and all(p["speedup"] == 1.0 for p in pairs)
    code, out, err = run(capsys, "bench", "--compare", str(tmp_path / "old.json"), "--compare",
                         str(tmp_path / "new.json"))
    assert code == 0 and "against" in out and "1.00x" in out


def test_the_roofline_places_gemms_by_their_bytes(tmp_path, monkeypatch):
    """Intensity is FLOPs over the result's own bytes: no label is parsed to find them."""
    from gpuwise import plot
    from gpuwise.bench.suite import BenchResult

    def gemm(n, dtype, size):
        return BenchResult(op="gemm", dtype=dtype, shape="not parsed", dims={"m": n, "n": n, "k": n}, device="cpu",
                           median_s=1.0, p10_s=1.0, p90_s=1.0, repeats=3, flops=2.0 * n**3, bytes=3.0 * n * n * size,
                           tflops=2.0 * n**3 / 1e12, gbps=None, peak_memory_bytes=None, pct_of_peak=None,
                           speedup_vs_cpu=None)

    points = []
    import matplotlib.axes

    real = matplotlib.axes.Axes.scatter
    monkeypatch.setattr(matplotlib.axes.Axes, "scatter", lambda self, x, y, **kw: points.append((x, y)) or
                        real(self, x, y, **kw))
    plot.plot_roofline([gemm(1024, "fp32", 4), gemm(1024, "bf16", 2)], tmp_path / "r.png", title="t",
                       ceilings={"fp32": 10.0}, peak_gbps=100.0)
    assert points[0][0] == [2 * 1024 / 3 / 4, 2 * 1024 / 3 / 2]  # 2n^3 / (3 n^2 x element bytes)
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_an_unwritable_or_damaged_calibration_cache_is_one_line_or_replaced(tmp_path):
    """A file where the cache folder goes, or a folder where the file goes, was exit 3 (NotADirectoryError);
    a damaged file is replaced by the new calibration."""
    from gpuwise.errors import GpuwiseError
    from gpuwise.hardware.calibration import Calibration, load_calibrations, save_calibration

    cal = Calibration(device="h100-sxm", tflops={"bf16": 700.0}, gbps=None)
    (tmp_path / "cache").write_text("")
    with pytest.raises(GpuwiseError, match=r"cannot store the calibration in .*cache/gpuwise/calibration.json: "
                                           r"Not a directory") as caught:
        save_calibration(cal, tmp_path / "cache" / "gpuwise")
    assert "XDG_DATA_HOME" in caught.value.hint
    (tmp_path / "a" / "calibration.json").mkdir(parents=True)
    with pytest.raises(GpuwiseError, match=r"cannot store the calibration in .*: cannot write .*: it is a folder"):
        save_calibration(cal, tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "calibration.json").write_text("{damaged")
    save_calibration(cal, tmp_path / "b")
    assert set(load_calibrations(tmp_path / "b")) == {"h100-sxm"}


def test_the_readme_and_help_give_the_same_bench_time(capsys, monkeypatch):
    """README said "about 30 s", --help "about a minute": both now quote one measured range."""
    import re
    from pathlib import Path

    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run(capsys, "bench", "--help")
    said = re.search(r"\((\d+-\d+ s) on a 2-core CPU", " ".join(out.split()))
    assert code == 0 and said, out
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    quoted = re.findall(r"gpuwise bench --quick .*?(\d+-\d+ s|about [\w ]+)", readme)
    assert quoted and set(quoted) == {said.group(1)}
