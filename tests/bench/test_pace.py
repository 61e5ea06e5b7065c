"""Issue 30: ``gpuwise bench --quick`` took 417 s on a 2-core CPU (a bf16 GEMM of 2048 ran 63.6 s a call where bf16
is emulated), printed nothing until the end, and Ctrl-C threw every result away. Now each case is sized from what the
run has measured (pace.py), rows print as their case finishes, and Ctrl-C, SIGTERM or SIGHUP keep them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import run_cli
from gpuwise.bench import suite
from gpuwise.bench.measure import Measurement
from gpuwise.bench.pace import Pace, case_seconds
from gpuwise.hardware.device import device_for

FAST = ["bench", "--quick", "--ops", "gemm,copy", "--dtype", "fp32", "--device", "cpu"]


def _timer(rates: dict[str, float], *, stall_s: float = 0.0, after=None):
    """A stand-in for run_case on a device whose GEMMs run at ``rates`` (FLOP/s by dtype), every call of the smallest
    GEMM waiting ``stall_s`` more (a busy CPU's scheduler slice); other ops take 1 ms. ``after(n)`` runs after the
    n-th case it timed. Records what it was asked to time."""
    timed = []

    def run_case(case, dev, *, warmup, repeats):
        timed.append((case.op, case.dtype, case.shape))
        if case.op == "gemm":
            call = case.estimate / rates[case.dtype] + (stall_s if case.dims["m"] <= 256 else 0.0)
        else:
            call = 1e-3
        m = Measurement(name=case.op, device=dev.name, warmup=warmup, repeats=repeats, times_s=(call,) * repeats,
                        median_s=call, p10_s=call, p90_s=call, peak_memory_bytes=None, flops=case.estimate,
                        bytes=case.bytes)
        if after:
            after(len(timed))
        return m, case.estimate, case.bytes

    run_case.timed = timed
    return run_case


def test_an_emulated_dtype_runs_its_small_gemm_and_says_why_it_skips_the_rest(monkeypatch):
    """fp32 at 100 GFLOP/s, bf16 at 0.3 (a CPU without bf16 units, as in the issue): the 256 bf16 GEMM runs, the 1024
    and 2048 ones are not run, each saying how long it would take, that bf16 is emulated, and the flag to force it.
    Before, all ran: 63.6 s a call for 2048."""
    timer = _timer({"fp32": 100e9, "bf16": 0.3e9})
    monkeypatch.setattr(suite, "run_case", timer)
    results = suite.run_suite("cpu", quick=True, ops=("gemm",), dtypes=("fp32", "bf16"), limit_s=5.0)
    ran = {(r.dtype, r.dims["m"]) for r in results if r.repeats}
    assert ran == {("fp32", 256), ("fp32", 1024), ("fp32", 2048), ("bf16", 256)}
    skipped = [r for r in results if not r.repeats]
    assert [r.dims["m"] for r in skipped] == [1024, 2048]
    for r in skipped:
        assert r.note.startswith("not run: about ") and "over the 5 s a case may take with --quick" in r.note
        assert "no native bf16 units here: emulated at 1/333 of fp32's rate" in r.note
        need = int(re.search(r"--case-limit (\d+)", r.note).group(1))
        assert need >= case_seconds(r.flops or 2.0 * r.dims["m"] ** 3 / 0.3e9)
    assert ("gemm", "bf16", "2048x2048 @ 2048x2048") not in timer.timed  # never started, not even one call


def test_a_stalled_small_gemm_does_not_skip_the_large_ones(monkeypatch):
    """On a busy 2-core machine every call of a 256 GEMM may wait 40 ms for a scheduler slice: a rate taken from it
    alone says 1024 takes 2.6 s a call. One call of 512 first corrects it, and every size runs."""
    timer = _timer({"fp32": 50e9}, stall_s=0.04)
    monkeypatch.setattr(suite, "run_case", timer)
    results = suite.run_suite("cpu", quick=True, ops=("gemm",), dtypes=("fp32",), limit_s=5.0)
    assert [r.dims["m"] for r in results if r.repeats] == [256, 1024, 2048]
    assert ("gemm", "fp32", "512x512 @ 512x512") in timer.timed  # the correction


def test_the_full_suite_runs_a_smaller_size_where_its_own_would_take_too_long(monkeypatch):
    """conv2d at the full suite's 64 x 64 x 56 x 56 would take about 2 s a case at 100 GFLOP/s (30% of it for a
    conv): with 1 s a case, the --quick size runs, and its row says so."""
    monkeypatch.setattr(suite, "run_case", _timer({"fp32": 100e9}))
    monkeypatch.setattr(suite, "_probe", lambda pace, dev, dtype: pace.learn(dtype, flops=1e9, seconds=0.01))
    (result,) = suite.run_suite("cpu", quick=False, ops=("conv2d",), dtypes=("fp32",), limit_s=1.0)
    assert result.repeats and result.shape == "8x64x56x56 3x3"
    assert result.note.startswith("smaller than the full suite's 64x64x56x56 3x3: about 2 s here (fp32 GEMMs at "
                                  "100 GFLOP/s, conv2d at 30% of it), over the 1 s a case may take; rerun with "
                                  "--case-limit 3 to time it")


def test_quick_stops_starting_cases_once_its_budget_is_spent(monkeypatch):
    """--quick's cases share a budget: on a clock where each case takes 2 s, a budget of 5 s runs three of four;
    the last says why, and the flag that runs it (a --case-limit drops the budget)."""
    from gpuwise.bench import pace as pace_module

    clock = [1000.0]
    monkeypatch.setattr(pace_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(suite, "run_case", _timer({}, after=lambda n: clock.__setitem__(0, clock[0] + 2.0)))
    monkeypatch.setattr(suite, "_probe", lambda pace, dev, dtype: pace.learn(dtype, flops=1e9, seconds=0.01))
    results = suite.run_suite("cpu", quick=True, ops=("attention", "conv2d", "block"), limit_s=5.0, budget_s=5.0)
    assert [r.repeats > 0 for r in results] == [True, True, True, False]
    assert re.fullmatch(r"not run: about [\d.]+ s here \(fp32 GEMMs at 100 GFLOP/s, block at 20% of it\), over the "
                        r"0 s left of the 5 s all cases may take with --quick; rerun with --case-limit 1 to time it "
                        r"\(0: no limit\)", results[-1].note)
    assert pace_module.limit_for(True, None) == (5.0, 40.0) and pace_module.limit_for(True, 60.0) == (60.0, None)


def test_a_slow_call_gives_up_warm_up_then_repeats_then_the_case():
    """Real calls of 0.05 s: with 1 s a case all runs fit; with 0.2 s the warm-up goes (the untimed first call
    warmed it) and 3 repeats stay; with 0.02 s not even those fit, and the case is not run, saying why."""
    def case(limit_s):
        return suite.Case(op="sleep", dtype="fp32", dims={}, shape="0.05 s", limit_s=limit_s,
                          make=lambda device: ((lambda: time.sleep(0.05)), None))

    cpu = device_for("cpu")
    m, _, _ = suite.run_case(case(1.0), cpu, warmup=1, repeats=3)
    assert (m.warmup, m.repeats) == (1, 3)
    m, _, _ = suite.run_case(case(0.2), cpu, warmup=1, repeats=3)
    assert (m.warmup, m.repeats) == (0, 3)
    with pytest.raises(suite.CaseTooLong, match=r"one call took [\d.]+ s: its 3 repeats would pass the 0\.02 s a "
                                                r"case may take; rerun with --case-limit \d+ to time it"):
        suite.run_case(case(0.02), cpu, warmup=1, repeats=3)


def test_a_real_tight_limit_skips_the_large_sizes_with_one_note_each(capsys):
    """A real run with 1 ms a case: the first GEMM makes one call (no CPU then fits 3 repeats in 2 ms), and from that
    call the larger ones are never started. Each row says why."""
    code, out, err = run_cli(capsys, *FAST, "--ops", "gemm", "--case-limit", "0.001", "--json")
    assert code == 0, err
    rows = json.loads(out)["results"]
    assert [r["repeats"] for r in rows] == [0, 0, 0]
    assert re.match(r"not run: one call took [\d.e-]+ s: its 3 repeats would pass the 0.001 s", rows[0]["note"])
    assert all(r["note"].startswith("not run: about ") and "over the 0.001 s a case may take with --quick" in r["note"]
               for r in rows[1:])


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_case_limit_that_is_no_number_of_seconds_is_one_line(capsys, value):
    code, _, err = run_cli(capsys, *FAST, "--case-limit", value)
    assert code == 2 and "--case-limit" in err and "(0: no limit)" in err and err.count("\n") == 1


def test_input_buffers_are_one_allocation_per_shape():
    """Hundreds of small tensors cost a scheduler slice each on a busy CPU (7 s for the 256 GEMM's buffers): they
    are views of one tensor per shape now, still as many and as large."""
    nxt = suite._rotating(((256, 256), (256, 256)), torch.float32, torch.device("cpu"))
    entries = [nxt() for _ in range(4)]
    a_storages = {a.untyped_storage().data_ptr() for a, _ in entries}
    assert len(a_storages) == 1 and len({a.data_ptr() for a, _ in entries}) == 4
    assert all(a.shape == (256, 256) and a.dtype == torch.float32 for a, _ in entries)


def test_pace_predicts_from_the_largest_gemm_it_saw():
    pace = Pace(limit_s=5.0)
    pace.learn("fp32", flops=1e6, seconds=1e-3)  # 1 GFLOP/s at a small size
    pace.learn("fp32", flops=1e9, seconds=0.01)  # 100 GFLOP/s at a larger one
    pace.learn("fp32", flops=1e6, seconds=1e-6)  # a smaller one later never replaces it
    assert pace.call_seconds("fp32", 1e10) == pytest.approx(0.1)
    assert pace.call_seconds("fp32", 1e10, share=0.25) == pytest.approx(0.4)
    assert pace.fits(1.0) and not pace.fits(1.5) and Pace(limit_s=None).fits(1e9)


# -- Ctrl-C, SIGTERM: what was measured stays -------------------------------------------------------------------

@pytest.fixture
def ctrl_c():
    """Ctrl-C raising KeyboardInterrupt, as in a terminal: a suite started in the background (`&` in a script, nohup)
    inherits SIGINT ignored, and so would the runs it starts."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _sigint_as_in_a_terminal() -> None:  # in the child, before exec: Python then installs its own handler
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_after(n: int, sig: int = signal.SIGINT):
    """As the n-th case is timed, this process gets ``sig`` for real (as from the terminal or a scheduler): that
    case is dropped, the ones before it kept."""
    def after(count):
        if count == n:
            os.kill(os.getpid(), sig)
    return after


def test_ctrl_c_in_a_real_run_keeps_the_rows_printed_and_saved(tmp_path):
    """A real `gpuwise bench` in its own process: its first row arrives while it still runs (rows stream), Ctrl-C
    (SIGINT) then stops it with exit 130, the rows printed so far, one line saying so, and --save holding them."""
    saved = tmp_path / "run.json"
    proc = subprocess.Popen([sys.executable, "-m", "gpuwise", "bench", "--ops", "gemm", "--dtype", "fp32", "--device",
                             "cpu", "--save", str(saved)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"},
                            preexec_fn=_sigint_as_in_a_terminal)
    try:
        seen = ""
        deadline = time.monotonic() + 120
        while not re.search(r"^ gemm ", seen, re.M) and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
        running = proc.poll() is None
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = seen + out
    assert proc.returncode == 130, err
    rows = re.findall(r"^ gemm\s+fp32\s+(\d+)x", out, re.M)
    assert running and len(rows) < 5, "the first row came only when the run had ended"  # 4096 takes seconds
    lines = [x for x in err.splitlines() if x.startswith("interrupted")]
    assert len(lines) == 1 and "Traceback" not in err, err
    said = "the row above is a complete measurement" if len(rows) == 1 else \
        f"the {len(rows)} rows above are complete measurements"
    assert lines[0] == f"interrupted after {len(rows)} of 5 cases: {said}, saved in {saved}"
    data = json.loads(saved.read_text())
    assert data["interrupted"] is True and [str(r["dims"]["m"]) for r in data["results"]] == rows
    assert rows[0] == "256" and all(r["repeats"] > 0 for r in data["results"])


def test_json_after_ctrl_c_holds_what_was_measured(capsys, monkeypatch, ctrl_c):
    """--json prints at the end: after a real SIGINT it prints the cases that finished, "interrupted": true."""
    monkeypatch.setattr(suite, "run_case", _timer({"fp32": 100e9}, after=_interrupt_after(3)))
    code, out, err = run_cli(capsys, *FAST, "--json")
    data = json.loads(out)
    assert code == 130 and data["interrupted"] is True
    assert [r["shape"] for r in data["results"]] == ["256x256 @ 256x256", "1024x1024 @ 1024x1024"]
    assert err.count("\n") == 1 and err.startswith("interrupted after 2 of 4 cases: the 2 results are complete")


def test_sigterm_stops_a_run_as_ctrl_c_does_with_exit_143(capsys, monkeypatch):
    """A scheduler's SIGTERM used to kill the run with nothing said: now the rows so far, one line, 128 + 15."""
    monkeypatch.setattr(suite, "run_case", _timer({"fp32": 100e9}, after=_interrupt_after(2, signal.SIGTERM)))
    before = signal.getsignal(signal.SIGTERM)
    code, out, err = run_cli(capsys, *FAST)
    assert code == 128 + signal.SIGTERM
    assert err == "interrupted (SIGTERM) after 1 of 4 cases: the row above is a complete measurement\n"
    assert re.search(r"^ gemm\s+fp32\s+256x256 @ 256x256\s", out, re.M) and "1024x1024 @" not in out
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


def test_an_interrupted_run_stores_no_calibration(capsys, tmp_path, monkeypatch, ctrl_c):
    """On a catalog GPU, --calibrate stores the best rates of a run; part of one would undercut the GPU in every later
    plan, so Ctrl-C stores none and says so."""
    from gpuwise.hardware import device as devices

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "cli"))
    from test_bench import _two_gpu_machine

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(devices, "local_machine", lambda environ: _two_gpu_machine())
    monkeypatch.setattr(suite, "device_for", lambda name: devices.CpuDevice(name=name))
    monkeypatch.setattr(suite, "run_case", _timer({"bf16": 500e12, "fp32": 50e12}, after=_interrupt_after(3)))
    code, _, err = run_cli(capsys, "bench", "--device", "cuda", "--quick", "--ops", "gemm,copy", "--dtype", "bf16",
                           "--calibrate")
    assert code == 130 and "calibration not stored: the run was interrupted" in err
    assert not (tmp_path / "gpuwise").exists()


# -- rows as they finish ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("width", [80, 40])
def test_streamed_rows_line_up_under_the_header_and_fit_the_terminal(width):
    """The table printed row by row has its widths before any case ran: at 80 columns every --quick row of a CPU,
    at the widest figures it reaches (an emulated dtype's 0.84 GF/s, a spread of 999%), is one line under the header;
    at 40 the least-needed columns go, as a whole table's would, and say so."""
    import io

    from rich.console import Console

    from gpuwise.bench import OPS
    from gpuwise.bench.run import BenchStart
    from gpuwise.render.bench import BenchStream

    planned = suite.cases(torch.device("cpu"), quick=True, ops=OPS, dtypes=("fp32", "bf16"))
    buf = io.StringIO()
    stream = BenchStream(Console(file=buf, width=width))
    stream.start(BenchStart(label="cpu (AMD EPYC), torch 2.13.0+cpu", peak=False, vs_cpu=False, cases=tuple(planned)))
    results = []
    for case in planned:
        r = suite.BenchResult(op=case.op, dtype=case.dtype, shape=case.shape, dims=case.dims, device="cpu",
                              median_s=0.12345, p10_s=0.0, p90_s=2.466, repeats=3, flops=1e8, bytes=None,
                              tflops=0.000838, gbps=None, peak_memory_bytes=None, pct_of_peak=None,
                              speedup_vs_cpu=None, backend=case.backend)
        stream.row(r)
        results.append(r)
    stream.finish(tuple(results))
    lines = buf.getvalue().splitlines()
    assert max(len(line) for line in lines) <= width and "…" not in buf.getvalue()
    rows = [line for line in lines if re.match(r" (gemm|copy|attention|conv2d|block|train-step) ", line)]
    assert len(rows) == len(planned)  # one line each: nothing folded onto a second
    if width == 80:
        header = next(line for line in lines if line.lstrip().startswith("op "))
        assert all(row.index("0.84 GF/s") + len("0.84 GF/s") == header.index("rate") + len("rate") for row in rows)
        assert all(" 999% " in row for row in rows) and "hidden" not in buf.getvalue()
    else:
        assert "hidden at 40 columns" in " ".join(lines)
