"""How the ``gpuwise`` process ends (cli.run): plan, recommend and gpus end once their output is flushed and the atexit
handlers have run, without Python's teardown (0.65 s of CPU of a cold plan); the output, the exit code and every
atexit handler are as a normal exit gives them, and GPUWISE_QUICK_EXIT=0 or a thread still running keeps the normal
exit. Real processes: the teardown is what is tested."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# A script run as the console script runs: an atexit handler of its own, and an object whose __del__ only Python's
# teardown of __main__ calls (it prints "teardown")
SCRIPT = r"""
import atexit, sys, threading
from gpuwise.cli import run

class Teardown:
    def __del__(self):
        sys.stderr.write("teardown\n")

kept = Teardown()
atexit.register(lambda: sys.stderr.write("handler ran\n"))
if sys.argv[1] == "thread":
    # not a daemon, and alive until the main thread ends: the normal exit waits for it
    threading.Thread(target=threading.main_thread().join).start()
    sys.argv.pop(1)
sys.argv = ["gpuwise", *sys.argv[1:]]
run()
"""


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, **env}
    if "GPUWISE_QUICK_EXIT" not in env:
        environ.pop("GPUWISE_QUICK_EXIT", None)
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], env=environ, capture_output=True, text=True,
                          timeout=120)


def test_a_quick_command_ends_without_teardown_but_with_its_output_code_and_atexit_handlers():
    out = _run("gpus", "h100", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)  # the whole JSON, flushed
    assert "handler ran" in out.stderr and "teardown" not in out.stderr
    bad = _run("plan", "--model", "no-such-model")
    assert bad.returncode == 2 and bad.stderr.splitlines()[0].startswith("error: "), bad.stderr
    assert "handler ran" in bad.stderr and "teardown" not in bad.stderr


def test_the_switch_or_a_running_thread_keeps_the_normal_exit():
    for out in (_run("gpus", "h100", "--json", GPUWISE_QUICK_EXIT="0"), _run("thread", "gpus", "h100", "--json")):
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)
        assert "handler ran" in out.stderr and "teardown" in out.stderr


def test_a_plan_that_ends_normally_unfreezes_first():
    """A plan freezes the planner's imports out of the collector (cli.CAPTURING); where it cannot end quickly (a
    thread of the user's still runs) they are unfrozen before the normal exit, whose teardown would otherwise have
    triton's bindings report them as leaked, after the plan's last line."""
    out = _run("thread", "plan", "--model", "mlp", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"]
    assert "teardown" in out.stderr and "leak" not in out.stderr.lower(), out.stderr[-2000:]
