"""The command line, through main() and as users run it (console script, python -m)."""

import json
import os
import subprocess
import sys
from importlib import resources

import pytest

from conftest import run_cli
from fakes.environments import cuda_env
from gpuwise.units import GB, GiB

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib


run = run_cli


# One run of each command in every output mode.
@pytest.mark.parametrize(
    "args",
    [["doctor"], ["doctor", "--json"], ["gpus"], ["gpus", "--json"], ["gpus", "h100"], ["gpus", "h100", "--json"],
     ["gpus", "--local"], ["gpus", "--local", "--json"], ["--version"], ["--help"], ["gpus", "--help"]],
)
def test_every_command_and_output_mode_runs(capsys, args):
    code, out, err = run(capsys, *args)
    # doctor exits 1 when this machine's stack has a failing check: still a successful run.
    assert code == 0 or (args[0] == "doctor" and code == 1), err
    assert out.strip() and not err
    if "--json" in args:
        json.loads(out)


def test_gpus_json_lists_the_whole_catalog_with_the_documented_keys(capsys):
    code, out, _ = run(capsys, "gpus", "--json")
    assert code == 0
    rows = json.loads(out)["accelerators"]
    raw = tomllib.loads(resources.files("gpuwise.hardware").joinpath("catalog.toml").read_text("utf-8"))
    assert [r["key"] for r in rows] == [r["key"] for r in raw["accelerator"]]
    for row in rows:
        assert {"name", "vendor", "segment", "memory_bytes", "memory_bandwidth_gbps", "peak_tflops", "tdp_w",
                "source"} <= set(row)
        assert set(row["peak_tflops"]) == {"fp32", "tf32", "fp16", "bf16", "fp8", "int8"}


def test_gpus_filters_agree_with_the_raw_data(capsys):
    code, out, _ = run(capsys, "gpus", "--segment", "consumer", "--min-memory", "24GB", "--json")
    assert code == 0
    raw = tomllib.loads(resources.files("gpuwise.hardware").joinpath("catalog.toml").read_text("utf-8"))
    expected = [r["key"] for r in raw["accelerator"]
                if r["segment"] == "consumer" and r["memory_gib"] * GiB >= 24 * GB]
    assert [r["key"] for r in json.loads(out)["accelerators"]] == expected
    assert "rtx-4090" in expected and "rtx-4060-ti-16gb" not in expected


def test_gpus_one_row(capsys):
    code, out, _ = run(capsys, "gpus", "RTX 4090", "--json")
    assert code == 0
    (row,) = json.loads(out)["accelerators"]
    assert row["key"] == "rtx-4090" and row["peak_tflops"]["bf16"] == 165.2


def test_gpus_local_json(capsys):
    code, out, _ = run(capsys, "gpus", "--local", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["cpu"]["logical_cores"] >= 1
    assert data["devices"][-1]["backend"] == "cpu"


def test_doctor_json_findings(capsys):
    code, out, _ = run(capsys, "doctor", "--json")
    findings = json.loads(out)["findings"]
    assert findings and all(set(f) == {"check", "status", "message", "fix"} for f in findings)
    assert all(f["status"] in ("ok", "warn", "fail") for f in findings)
    assert code == (1 if any(f["status"] == "fail" for f in findings) else 0)


def test_doctor_exits_1_when_a_check_fails(capsys, monkeypatch):
    monkeypatch.setattr("gpuwise.environment.gather_environment", lambda environ: cuda_env(driver="535.104.05"))
    code, out, _ = run(capsys, "doctor")
    assert code == 1 and "FAIL" in out
    code, out, _ = run(capsys, "doctor", "--json")
    failed = [f for f in json.loads(out)["findings"] if f["status"] == "fail"]
    assert code == 1 and [f["check"] for f in failed] == ["driver"] and "too old" in failed[0]["message"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["gpus", "h1000"], "error: unknown GPU 'h1000' (hint: closest: h100-sxm"),
        (["gpus", "--segment", "gaming"], "error: unknown segment 'gaming' (hint: use one of consumer"),
        (["gpus", "--vendor", "nvidea"], "error: unknown vendor 'nvidea'"),
        (["gpus", "--min-memory", "lots"], "error: cannot read the size 'lots' (hint:"),
        (["gpus", "--local", "h100"], "error: --local shows this machine and takes no name"),
        (["gpus", "--local", "--segment", ""], "error: --local shows this machine and takes no name"),
        (["gpus", "4090", "--segment", "datacenter"], "error: a NAME shows one accelerator and takes no filters"),
        (["gpus", "--min-memory", ""], "error: cannot read the size ''"),
        (["gpus", "--min-memory", "9" * 300 + "GB"], "error: the size '999"),
        (["gpus", "--segment", ""], "error: unknown segment ''"),
        (["gpus", ""], "error: unknown GPU ''"),
        (["doctor", "--jsn"], "error: No such option: --jsn"),
        (["doctr"], "error: No such command 'doctr'"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith(message)
    assert err.count("\n") == 1 and "(hint: " in err and "Traceback" not in err


def test_bare_command_prints_help_and_exits_0(capsys):
    code, out, err = run(capsys)
    assert code == 0 and "doctor" in out and "gpus" in out and not err


def test_segment_and_vendor_ignore_case(capsys):
    code, out, _ = run(capsys, "gpus", "--segment", "Consumer", "--vendor", "nvidia", "--json")
    assert code == 0 and {r["segment"] for r in json.loads(out)["accelerators"]} == {"consumer"}


def test_a_bug_is_one_line_and_exit_3(capsys, monkeypatch):
    def broken():
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr("gpuwise.hardware.catalog.load_catalog", broken)
    code, out, err = run(capsys, "gpus")
    assert code == 3 and out == "" and err.startswith("error: internal error: ZeroDivisionError")
    assert err.count("\n") == 1


def _gpuwise(*args, env=None):
    return subprocess.run([sys.executable, "-m", "gpuwise", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_python_dash_m_and_debug_traceback():
    plain = _gpuwise("gpus", "h1000")
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    debug = _gpuwise("gpus", "h1000", env={"GPUWISE_DEBUG": "1"})
    assert debug.returncode == 2 and "Traceback" in debug.stderr and "GpuwiseError" in debug.stderr


def test_console_script_is_installed():
    script = os.path.join(os.path.dirname(sys.executable), "gpuwise")
    result = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("gpuwise ")
