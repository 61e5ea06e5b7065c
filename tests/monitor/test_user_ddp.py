"""Communication timed in a user's own DDP loop (``Monitor.ddp`` → ``monitor.comm.attach``): the hook's bookkeeping
in one gloo process (what take() gives after a synchronising backward, after no_sync, after two; the gradients
unchanged; the errors), and real two-process runs of a plain loop (``ddp_user_loop.py``) whose all-reduce dwarfs
its work: rank 0 is communication-bound with its exposed communication equal, within noise, to what the all-reduce
adds to its backward (the same backward timed under no_sync); with one rank slowed in its data, the joined events of
both ranks name that rank the straggler. Wide margins and medians: the CPU is shared."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpuwise.errors import GpuwiseError
from gpuwise.monitor.comm import CommTimer, attach
from gpuwise.monitor.rules import judge
from gpuwise.monitor.samples import Record, read_log
from gpuwise.monitor.verdict import Context

LOOP = Path(__file__).with_name("ddp_user_loop.py")
STEPS = 6  # 2 warm-up steps skipped, 4 judged: the fewest that leave a median with a margin (MIN_JUDGED_STEPS 3)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A one-process gloo group (DDP needs one): the hook runs as it does with more ranks."""
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    store = tmp_path_factory.mktemp("store") / "file"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def ddp_model(seed: int = 0) -> tuple[nn.Module, nn.parallel.DistributedDataParallel]:
    torch.manual_seed(seed)
    inner = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    return inner, nn.parallel.DistributedDataParallel(inner)


def test_take_gives_the_synchronising_backwards_since_the_last_take(one_rank):
    _, model = ddp_model()
    timer = attach(model)
    assert timer.take() == (None, None)  # nothing yet
    x = torch.randn(16, 64)
    model(x).sum().backward()
    comm, exposed = timer.take()
    assert comm is not None and exposed is not None and 0 <= exposed < 5 and comm >= 0
    assert timer.take() == (None, None)  # taken
    with model.no_sync():  # no all-reduce, no hook: nothing to take
        model(x).sum().backward()
    assert timer.take() == (None, None)
    model(x).sum().backward()
    model(x).sum().backward()
    comm2, exposed2 = timer.take()
    assert comm2 is not None and exposed2 is not None and exposed2 >= 0  # two backwards summed


def test_the_hook_leaves_the_gradients_as_ddp_makes_them(one_rank):
    inner, model = ddp_model()
    reference = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    reference.load_state_dict(inner.state_dict())
    attach(model)
    x = torch.randn(16, 64)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for p, q in zip(inner.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)  # one rank: the average over the ranks is its own gradient


def test_the_trainers_comm_timer_keeps_its_interface(one_rank):
    _, model = ddp_model()
    timer = CommTimer(model, torch.device("cpu"))
    timer.begin()
    model(torch.randn(4, 64)).sum().backward()
    timer.end()
    comm, exposed = timer.take()
    assert comm is not None and exposed is not None and exposed >= 0


def test_not_ddp_or_already_hooked_is_a_one_line_error(one_rank):
    with pytest.raises(GpuwiseError, match="DistributedDataParallel model, not Sequential") as e:
        attach(nn.Sequential(nn.Linear(2, 2)))
    assert "DistributedDataParallel(model)" in e.value.hint and "\n" not in str(e.value)
    _, model = ddp_model()
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model.register_comm_hook(state=None, hook=allreduce_hook)
    with pytest.raises(GpuwiseError, match="already has a communication hook") as e:
        attach(model)
    assert "mon.ddp(model)" in e.value.hint
    _, model = ddp_model()
    attach(model)
    with pytest.raises(GpuwiseError, match="already has a communication hook"):
        attach(model)  # twice


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_loop(tmp_path: Path, steps: int, *extra: str, torchrun: bool = False) -> tuple[dict, Path]:
    """The user loop on two gloo ranks; rank 0's results and every rank's events file."""
    out, events = tmp_path / "out.json", tmp_path / "events.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GPUWISE_WATCH_EVENTS": str(events)}
    args = [str(LOOP), str(out), str(steps), *extra]
    if torchrun:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               *args], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    else:  # what torchrun sets, without its agent (seconds saved on a 2-core box)
        base = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2"}
        procs = [subprocess.Popen([sys.executable, *args], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
        try:
            results = [p.communicate(timeout=300) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for p, (_, err) in zip(procs, results, strict=True):
            assert p.returncode == 0, err[-3000:]
    return json.loads(out.read_text()), events


def test_a_user_ddp_loop_whose_all_reduce_dwarfs_its_work_reports_its_exposed_communication(tmp_path):
    result, events = run_loop(tmp_path, STEPS)
    d = result["diagnosis"]
    found = [f["bottleneck"] for f in d["findings"]]
    # primary on a quiet box; on a saturated one the load's own classes (oversubscribed, a rank the load slowed: a
    # straggler) may rank above it, and the exposed communication must still be found
    assert d["bottleneck"] == "communication-bound" or (
        "communication-bound" in found and set(found[:found.index("communication-bound")]) <= {"oversubscribed",
                                                                                              "straggler", "stalls"}), d
    comm = next(f for f in d["findings"] if f["bottleneck"] == "communication-bound")
    steps = result["steps"]
    assert len(steps) == STEPS and all(s["exposed_comm_s"] is not None and s["comm_s"] is not None for s in steps)
    for s, backward in zip(steps, result["backward_s"], strict=True):
        assert 0 <= s["exposed_comm_s"] <= backward + 0.01 <= s["seconds"] + 0.01  # inside backward, inside the step
    # the reference: what the all-reduce adds to the same backward (timed under no_sync). Measured 0.058-0.109 s
    # exposed against 0.064-0.116 s added (4 runs on the loaded 2-core box); CI under `-n 2` once measured 0.095
    # against 0.197 (the two phases ran under different load): within 1/3-2x, the same order as the reference
    added = statistics.median(result["backward_s"]) - statistics.median(result["local_backward_s"])
    exposed = statistics.median(s["exposed_comm_s"] for s in steps[2:])
    assert added > 0.01, result
    assert added / 3 <= exposed <= 2 * added + 0.01, (exposed, added)
    assert result["grad_diff"] < 1e-5  # the hook's gradients are DDP's average
    assert result["no_sync_exposed"] == [None] * STEPS  # no all-reduce, nothing taken
    assert any("accumulation" in f for f in comm["fix"]) and "per micro-batch" in comm["expected"]
    # every rank wrote its events: joined, the link (the least-waiting rank's exposed time) is still a loss. Whether
    # a rank straggles here depends on what else holds the 2 cores (seen: one rank 23% behind under load 6), so
    # the must-not-fire straggler cases are the synthetic ones in test_comm_rules.py
    rec = read_log(events)
    rec = Record(steps=tuple(s for s in rec.steps if s.step <= STEPS))
    assert {s.rank for s in rec.steps} == {0, 1}
    d = judge(rec, Context(device="cpu", usable_cores=2, world_size=2))
    comm = [f for f in d.findings if f.bottleneck == "communication-bound"]
    assert comm and comm[0].evidence["exposed_comm_from"].startswith("the least-waiting of 2 ranks"), d


@pytest.mark.slow
def test_torchrun_with_one_rank_slow_to_load_names_it_the_straggler(tmp_path):
    # rank 1 sleeps 0.15 s for each batch: rank 0 waits for it in the all-reduce, step after step
    _, events = run_loop(tmp_path, 12, "1", "0.15", torchrun=True)
    rec = read_log(events)
    rec = Record(steps=tuple(s for s in rec.steps if s.step <= 12))
    d = judge(rec, Context(device="cpu", usable_cores=2, world_size=2))
    found = [f.bottleneck for f in d.findings]
    assert d.bottleneck == "straggler" or found[:2] == ["oversubscribed", "straggler"], d
    e = next(f for f in d.findings if f.bottleneck == "straggler").evidence
    assert e["straggler_rank"] == 1 and e["data_wait_s"][1] >= 0.12 and e["data_wait_s"][0] < 0.05
    assert e["exposed_comm_s"][0] > e["exposed_comm_s"][1]  # the others wait longer in communication
    assert next(f for f in d.findings if f.bottleneck == "straggler").fix[0].startswith("rank 1's data")
