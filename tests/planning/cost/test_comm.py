"""cost/comm.py against independent references: the measured table's own points, nccl-tests' bus-bandwidth formulas,
a DDP bucket schedule and an FSDP prefetch worked by hand, the one-micro-batch pipeline as the sum of its stages,
Megatron's collective count, and the scaling of an 8-GPU DDP BERT-large on a PCIe box and on an HGX board."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gpuwise.hardware.catalog import load_catalog
from gpuwise.planning.cost import comm
from gpuwise.planning.cost.comm import (
    DDP_BUCKET_BYTES,
    NCCL_SM_SHARE,
    NO_COMM,
    Comm,
    bus_factor,
    collective_seconds,
    data_parallel,
    ddp_buckets,
    overlap,
    pipeline,
    tensor_parallel,
)
from gpuwise.planning.parallel.sharding import PerGpu
from gpuwise.planning.setup import Setup

CATALOG = load_catalog()
MiB = 2**20
ROOT = Path(__file__).resolve().parents[3]
# one catalog row per architecture the table measured; sm_103 (GB300 NVL72) has no row: GB200's, renamed
ARCH_ACC = {"sm_90": CATALOG.get("h100-sxm"), "sm_100_B200": CATALOG.get("b200"),
            "sm_100_GB200": CATALOG.get("gb200"), "sm_103": dataclasses.replace(CATALOG.get("gb200"), key="gb300"),
            "gfx950": CATALOG.get("mi355x")}


def _step(setup: Setup, **workload) -> PerGpu:
    fields = {"params": 0, "trainable_params": 0, "block_bytes": 0, "block_trainable_params": 0, "expert_params": 0,
              "embeddings": (), "tokens_per_step": 0, **workload}
    fields["params"] = fields["params"] or fields["trainable_params"]
    return PerGpu(workload=SimpleNamespace(**fields), setup=setup, timeline=None, batch_model=None, live=None,
                  peak_bytes=0)


def test_bus_factors_are_nccl_tests():
    """NVIDIA/nccl-tests PERFORMANCE.md: busBw = algBw x 2(n-1)/n (all-reduce), x (n-1)/n (all-gather,
    reduce-scatter, all-to-all), x 1 (send/recv)."""
    assert bus_factor("all-reduce", 8) == 2 * 7 / 8
    assert bus_factor("all-gather", 8) == bus_factor("reduce-scatter", 8) == bus_factor("all-to-all", 8) == 7 / 8
    assert bus_factor("send/recv", 2) == 1.0
    with pytest.raises(ValueError, match="all-reduce"):
        bus_factor("broadcast", 8)
    # the bus bandwidth a result reports is size x factor / seconds
    c = collective_seconds("all-gather", 64 * MiB, 4, CATALOG.get("a100-40gb-sxm"))
    assert c.busbw_gbps == pytest.approx(64 * MiB * 3 / 4 / c.seconds / 1e9)


def test_interpolation_returns_the_tables_points():
    """Every measured point of the table comes back exactly: seconds = bytes / throughput (OpenXLA's
    collective_perf_table_gen: throughput = tensor bytes / median runtime)."""
    rows = comm._data()["rows"]
    checked = 0
    for r in rows:
        arch, op, pattern, dtype, group, _groups, nbytes, throughput = r
        if op == "send/recv":
            preferred = "mutual" if arch in ("sm_100_GB200", "sm_103") else "one-way"
            if pattern != preferred:
                continue
            group = 2
        c = collective_seconds(op, nbytes, group, ARCH_ACC[arch], dtype=dtype)
        assert c.seconds == pytest.approx(nbytes / throughput, rel=1e-9), r
        assert "OpenXLA" in c.source
        checked += 1
    assert checked > 3000


def test_the_table_between_and_beyond_its_points():
    h100 = CATALOG.get("h100-sxm")
    smallest = min(r[6] for r in comm._data()["rows"] if r[0] == "sm_90" and r[1] == "all-reduce" and r[4] == 8)
    floor = collective_seconds("all-reduce", smallest, 8, h100).seconds
    assert collective_seconds("all-reduce", 8, 8, h100).seconds == pytest.approx(floor)  # latency-bound below
    big = [collective_seconds("all-reduce", s, 8, h100).busbw_gbps for s in (2**31, 2**33, 2**36)]
    assert big[0] == pytest.approx(big[1]) == pytest.approx(big[2])  # the last measured bandwidth beyond
    # between two measured sizes the time lies between theirs; between groups 4 and 8 the bus bandwidth too
    t = [collective_seconds("all-reduce", s, 8, h100).seconds for s in (2**26, 1.5 * 2**26, 2**27)]
    assert t[0] < t[1] < t[2]
    bw = [collective_seconds("all-reduce", 2**28, n, h100).busbw_gbps for n in (4, 6, 8)]
    assert min(bw[0], bw[2]) < bw[1] < max(bw[0], bw[2])


def test_the_link_model_and_its_fit():
    """The alpha-beta fit in collectives.json is what scripts/derive_collectives.py's fit gives on the committed
    table, and it reports its error on the held-out architectures."""
    spec = importlib.util.spec_from_file_location("derive_collectives", ROOT / "scripts" / "derive_collectives.py")
    derive = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(derive)
    data = comm._data()
    fitted = derive.fit(data["rows"])
    link_fit = data["link_fit"]
    assert set(link_fit["fit_on"]).isdisjoint(link_fit["held_out"])
    for op, f in link_fit["ops"].items():
        assert (fitted[op]["alpha_us"], fitted[op]["efficiency"]) == (f["alpha_us"], f["efficiency"]), op
        assert set(f["error"]) == set(link_fit["fit_on"]) | set(link_fit["held_out"])
    # at large sizes the link model runs at its share of the line rate: a100-40gb-sxm, NVLink 3 600/2 GB/s
    alpha, eff = comm.link_fit("all-reduce")
    c = collective_seconds("all-reduce", 2**34, 8, CATALOG.get("a100-40gb-sxm"))
    assert c.busbw_gbps == pytest.approx(300 * eff, rel=1e-3)
    assert collective_seconds("all-reduce", 1, 8, CATALOG.get("a100-40gb-sxm")).seconds == pytest.approx(alpha)


def test_boxes_pcie_bridges_and_networks():
    """A PCIe server holds 8 cards whatever its bridges pair: 8 RTX 5090 stay in one box near the 28 GB/s
    nccl#1639 measured (the 0.36 of it a 4-card 'node' gave), a bridged pair uses its NVLink, more cards PCIe."""
    rtx5090 = CATALOG.get("rtx-5090")
    eight = collective_seconds("all-reduce", 2**31, 8, rtx5090)
    assert "across boxes" not in eight.source
    assert 0.8 < eight.busbw_gbps / 28 < 1.3
    assert collective_seconds("all-reduce", 2**31, 4, rtx5090).busbw_gbps == pytest.approx(35, rel=0.01)  # measured
    rtx3090 = CATALOG.get("rtx-3090")
    assert "NVLink" in collective_seconds("all-reduce", 2**30, 2, rtx3090).source
    assert "PCIe" in collective_seconds("all-reduce", 2**30, 4, rtx3090).source
    assert "across boxes" not in collective_seconds("all-reduce", 2**30, 8, CATALOG.get("h100-pcie")).source
    # beyond the box: 400 Gb/s IB per GPU at 0.82
    h100 = CATALOG.get("h100-sxm")
    assert collective_seconds("all-reduce", 2**34, 16, h100).busbw_gbps == pytest.approx(50 * 0.82, rel=0.01)
    assert collective_seconds("all-reduce", 2**30, 2, CATALOG.get("m2-ultra-76c")) is None  # a SoC: no link
    for acc in CATALOG:  # every row: a time, or None for a device with no link
        for n in (2, 8, 16):
            c = collective_seconds("all-reduce", 25 * MiB, n, acc)
            assert c is None or (math.isfinite(c.seconds) and c.seconds > 0), (acc.key, n)


def test_overlap_and_buckets_by_hand():
    # ready at 1, 2, 3 s taking 1.5, 0.5, 2 s, backward ending at 3: done at 2.5, 3.0, 5.0 -> 2 s exposed; before
    # 3 s the first ran 1.5 s and the second 0.5 s
    assert overlap(np.array([1.0, 2.0, 3.0]), np.array([1.5, 0.5, 2.0]), 3.0) == pytest.approx((2.0, 2.0))
    sizes, last = ddp_buckets(36 * MiB, [30 * MiB])  # 1 MiB, 25 MiB, then 10 MiB + the 30 MiB embedding
    assert sizes.tolist() == [1 * MiB, 25 * MiB, 40 * MiB] and last.tolist() == [False, False, True]
    assert ddp_buckets(60 * MiB)[0].tolist() == [1 * MiB, 25 * MiB, 25 * MiB, 9 * MiB]


def test_ddp_schedule_worked_by_hand():
    """36 MiB of fp32 gradients spread over a 0.1 s backward, then a 30 MiB embedding's at its end: buckets of 1,
    25 and 40 MiB ready at 1/36, 26/36 and 36/36 of it, each all-reduced after the one before."""
    acc = CATALOG.get("rtx-4090")  # 8 cards: PCIe 4.0 through the host
    setup = Setup(gpus=8, precision="bf16-mixed")
    step = _step(setup, trainable_params=(36 + 30) * MiB // 4, embeddings=((7680, 4096),))
    backward = 0.1
    t = [collective_seconds("all-reduce", b * MiB, 8, acc).seconds for b in (1, 25, 40)]
    e1 = backward / 36 + t[0]
    e2 = max(backward * 26 / 36, e1) + t[1]
    e3 = max(backward, e2) + t[2]
    hidden = sum(max(0.0, min(end, backward) - (end - dt)) for end, dt in zip((e1, e2, e3), t, strict=True))
    got = data_parallel(step, acc, forward_s=0.05, backward_s=backward)
    assert got.total_s == pytest.approx(sum(t))
    assert got.exposed_s == pytest.approx(e3 - backward + NCCL_SM_SHARE * hidden)
    # no_sync: with 4 micro-batches only the last one's backward (a quarter) hides the buckets
    accum = data_parallel(_step(dataclasses.replace(setup, grad_accum=4), trainable_params=(36 + 30) * MiB // 4,
                                embeddings=((7680, 4096),)), acc, forward_s=0.2, backward_s=4 * backward)
    assert accum.exposed_s == pytest.approx(got.exposed_s)
    assert data_parallel(_step(Setup(), trainable_params=10**9), acc, forward_s=1, backward_s=2) is NO_COMM


def test_fsdp_prefetch_worked_by_hand():
    # two units of 2 s each, gathers of 1 s: the first gather exposed, the second hidden behind unit 0
    assert comm._fsdp_pass(4.0, 2, 1.0, 0.0) == pytest.approx((5.0, 1.0))
    # backward with 0.5 s reduce-scatters: the last one after the last unit is exposed too
    assert comm._fsdp_pass(4.0, 2, 1.0, 0.5) == pytest.approx((5.5, 1.5))
    setup = Setup(gpus=8, sharding="fsdp", precision="bf16-mixed")
    step = _step(setup, trainable_params=8 * 10**9, block_bytes=2 * 8 * 10**9 // 32)  # 32 units
    acc = CATALOG.get("h100-sxm")
    got = data_parallel(step, acc, forward_s=1.0, backward_s=2.0)
    gather = collective_seconds("all-gather", 2 * 8e9 / 32, 8, acc).seconds
    reduce = collective_seconds("reduce-scatter", 4 * 8e9 / 32, 8, acc, dtype="f32").seconds
    assert got.total_s == pytest.approx(32 * (2 * gather + reduce))
    assert 2 * gather + reduce <= got.exposed_s < got.total_s  # a gather before each pass, the last reduce after


def test_bert_large_ddp_scales_well_below_one_on_pcie():
    """An 8-GPU DDP BERT-large (340M parameters, Devlin et al. 2018; tied embeddings), fp32 gradients, 32 x 128
    tokens a GPU at 6 x params FLOPs a token and 40% of the datasheet fp16 rate (assumed): on 8 RTX 4090 through
    PCIe the all-reduce outlasts backward (published 8-GPU runs: 0.61-0.99); on an HGX H100 it hides."""
    setup = Setup(gpus=8, precision="fp16-mixed", micro_batch=32, seq=128)
    step = _step(setup, trainable_params=340 * 10**6)
    eff = {}
    for key in ("rtx-4090", "h100-sxm"):
        acc = CATALOG.get(key)
        compute = 6 * 340e6 * 32 * 128 / (0.4 * acc.peak_tflops.get("fp16") * 1e12)
        got = data_parallel(step, acc, forward_s=compute / 3, backward_s=2 * compute / 3)
        eff[key] = compute / (compute + got.exposed_s)
    assert 0.5 < eff["rtx-4090"] < 0.85
    assert eff["h100-sxm"] > 0.9


def test_one_micro_batch_pipeline_is_the_sum_of_its_stages():
    acc = CATALOG.get("h100-sxm")
    stages = [0.10, 0.12, 0.10, 0.11]
    one = pipeline(Setup(gpus=4, pp=4), acc, stage_s=stages, boundary=4 * MiB)
    hop = collective_seconds("send/recv", 4 * MiB, 2, acc).seconds
    assert max(stages) + one.bubble_s == pytest.approx(sum(stages))  # one GPU's whole step, not 4 x the slowest
    assert one.exposed_s == pytest.approx(2 * 3 * hop)  # forward and backward through 3 boundaries
    # balanced, 8 micro-batches: (m + pp - 1) slots, the bubble (pp - 1) / (m + pp - 1) of them (Setup's rule)
    setup = Setup(gpus=4, pp=4, grad_accum=8)
    got = pipeline(setup, acc, stage_s=[0.1] * 4, boundary=4 * MiB)
    assert got.bubble_s / (8 * 0.1 + got.bubble_s) == pytest.approx(setup.pipeline_bubble)
    assert pipeline(Setup(), acc, stage_s=[1.0], boundary=1.0) is NO_COMM
    with pytest.raises(ValueError, match="4 pipeline stages"):
        pipeline(setup, acc, stage_s=[0.1] * 3, boundary=1.0)


def test_tensor_parallel_counts_megatrons_all_reduces():
    """Shoeybi et al. 2019 sec. 3: two all-reduces per transformer layer in forward and two in backward, of
    b x s x h; sequence parallelism turns each into an all-gather and a reduce-scatter of the same size."""
    acc = CATALOG.get("h100-sxm")
    size = 4096 * 4096 * 2
    ar = collective_seconds("all-reduce", size, 8, acc, dtype="bf16").seconds
    train = tensor_parallel(acc, tp=8, tokens=4096, hidden=4096, blocks=32, itemsize=2, calls=2)
    assert train.exposed_s == train.total_s == pytest.approx(2 * 32 * 2 * 2 * ar)
    decode = tensor_parallel(acc, tp=8, tokens=16, hidden=4096, blocks=32, itemsize=2, passes=1)
    assert decode.total_s == pytest.approx(2 * 32 * collective_seconds("all-reduce", 16 * 4096 * 2, 8, acc).seconds)
    sp = tensor_parallel(acc, tp=8, tokens=4096, hidden=4096, blocks=32, itemsize=2, calls=2, sp=True)
    assert 0.5 < sp.total_s / train.total_s < 2  # a ring all-reduce is a reduce-scatter then an all-gather
    assert tensor_parallel(acc, tp=1, tokens=1, hidden=1, blocks=1, itemsize=2) is NO_COMM


def test_expert_all_to_alls_move_the_busiest_gpus_bytes():
    """Today's semantics (AllToAll.busiest over the link's all-to-all bandwidth), now per collective with its
    latency."""
    from gpuwise.planning.parallel.expert import AllToAll

    acc = CATALOG.get("a100-40gb-sxm")
    a2a = AllToAll(moe_layers=4, tokens=8192, top_k=2, hidden=2048, itemsize=2, ep=8, factor=1.25)
    got = comm.expert_parallel(a2a, acc)
    alpha, eff = comm.link_fit("all-to-all")
    calls = 4 * a2a.exchanges
    assert got.total_s == pytest.approx(calls * alpha + a2a.busiest / (eff * 300e9), rel=1e-6)


def test_comm_adds_phase_by_phase():
    total = Comm(total_s=1.0, exposed_s=0.25, basis="a") + Comm(total_s=2.0, exposed_s=2.0, bubble_s=0.5, basis="b")
    assert (total.total_s, total.exposed_s, total.bubble_s, total.basis) == (3.0, 2.25, 0.5, "a · b")


def test_bucket_sizes_are_torchs():
    import torch.distributed as dist
    from torch.nn.parallel import distributed as ddp

    assert ddp._DEFAULT_BUCKET_CAP_MB * ddp._MB_TO_BYTES == DDP_BUCKET_BYTES
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == comm.DDP_FIRST_BUCKET_BYTES
