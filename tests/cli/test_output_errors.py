"""Output that cannot be written is the user's environment, not our bug: exit 2 and one line (issue 30)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("args", [["gpus", "--json"], ["gpus"]], ids=["json", "table"])
def test_output_to_a_full_device_is_exit_2_with_one_line(args):
    """Issue 30: `plan --json > /dev/full` was exit 3 "internal error". `gpus` prints without a capture, so the
    write itself meets the full device, as the plan's does."""
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "gpuwise", *args], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert lines == ["error: No space left on device writing the output (hint: free space there (df -h), or send "
                     "the output elsewhere)"]


def _gpus_at(columns: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "COLUMNS": columns}
    return subprocess.run([sys.executable, "-m", "gpuwise", "gpus"], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.fixture(scope="module")
def gpus_at_80() -> subprocess.CompletedProcess:
    """What `COLUMNS=80 gpuwise gpus` prints: the reference each width below is compared with, run once."""
    return _gpus_at("80")


@pytest.mark.parametrize("columns", ["0", "-5", "wide"])
def test_a_columns_that_is_no_width_prints_as_if_unset(columns, gpus_at_80):
    """Issue 30: `COLUMNS=0 gpuwise gpus` printed nothing and exited 0 (rich took a width of 0)."""
    run = _gpus_at(columns)
    assert run.returncode == 0 and run.stdout == gpus_at_80.stdout
    assert "gpuwise hardware catalog" in run.stdout
