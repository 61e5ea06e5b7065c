"""Predicted training throughput against published measurements (planner-anchors.md §6, exact configs).

Scored only: the step-time model (cost/step.py over cost/kernels.py) is fitted on per-kernel microbenchmarks, none
of these runs (benchmarks/speed_truth.py scores them with every other published run).
Predictions only: the step is captured on fake tensors, nothing runs on a GPU.

    python benchmarks/speed_validation.py          # the table, and the fit
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

from gpuwise.hardware.catalog import load_catalog
from gpuwise.models import get_model
from gpuwise.models.gpt import GPTConfig
from gpuwise.planning.capture.workload import simulate
from gpuwise.planning.cost import step as costmodel
from gpuwise.planning.parallel.sharding import capture_setup, per_gpu
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.zoo import ZooSource
from gpuwise.units import GiB


@dataclasses.dataclass(frozen=True)
class Anchor:
    id: int
    what: str
    model: str
    setup: Setup
    gpu: str  # catalog key
    measured_tok_s_per_gpu: float
    source: str
    memory_gib: int | None = None  # the SKU differs from the catalog row in memory only


def _mpt7b() -> ZooSource:
    """MPT-7B (mosaicml/mpt-7b config: 32 layers, d_model 4096, 32 heads, ffn 4x, vocab 50432) as a GPT; MPT
    has ALiBi and no biases, a GPT learned positions and biases: 6.7B parameters either way."""
    gpt = get_model("gpt2")
    cfg = GPTConfig(n_layer=32, n_head=32, n_embd=4096, vocab_size=50432, block_size=4096)
    return ZooSource(zoo=dataclasses.replace(gpt, name="mpt-7b", config=cfg, default_seq=2048, max_seq=4096))


SOURCES = {"llama3-8b": lambda: ZooSource(zoo=get_model("llama3-8b")), "mpt-7b": _mpt7b,
           "gpt2": lambda: ZooSource(zoo=get_model("gpt2"))}
_TT = "pytorch/torchtitan docs/performance.md"
_LF = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
ANCHORS = (
    Anchor(3, "Llama 3.1 8B, 8x H100 96GB, FSDP, bs 2, seq 8192", "llama3-8b",
           Setup(micro_batch=2, seq=8192, gpus=8, sharding="fsdp"), "h100-sxm", 5762, _TT, memory_gib=96),
    Anchor(4, "same on 128 GPUs", "llama3-8b",
           Setup(micro_batch=2, seq=8192, gpus=128, sharding="fsdp"), "h100-sxm", 5605, _TT, memory_gib=96),
    Anchor(5, "Llama 3 8B, 64x A100 80GB, FSDP2, bs 1, seq 8192", "llama3-8b",
           Setup(micro_batch=1, seq=8192, gpus=64, sharding="fsdp"), "a100-80gb-sxm", 2973, _TT + " (older)"),
    Anchor(6, "MPT-7B, 8x H100, seq 2048, mb 6, FULL_SHARD", "mpt-7b",
           Setup(micro_batch=6, seq=2048, gpus=8, sharding="fsdp"), "h100-sxm", 10643, _LF),
    Anchor(7, "MPT-7B, 8x H100, seq 4096, mb 16, ga 2, AC", "mpt-7b",
           Setup(micro_batch=16, seq=4096, grad_accum=2, gpus=8, sharding="fsdp", checkpointing="full"),
           "h100-sxm", 8611, _LF),
    Anchor(13, "GPT-2 124M nanoGPT, 8x A100 40GB, mb 12, ga 5, DDP", "gpt2",
           Setup(micro_batch=12, seq=1024, grad_accum=5, gpus=8), "a100-40gb-sxm", 109_300, "karpathy/nanoGPT#110"),
)
# The kernel-time model (cost/kernels.py) is fitted on per-kernel measurements only: every anchor is held out. FIT
# names the anchors the retired matmul share was fitted on (before issue 26), for the record.
FIT: dict[tuple[str, ...], tuple[int, ...]] = {}
HELD_OUT = (3, 4, 5, 6, 7, 13)
# Selective activation checkpointing (#3-#5) recomputes only cheap ops: captured as none.


def step_of(anchor: Anchor):
    w = simulate(SOURCES[anchor.model](), capture_setup(anchor.setup), batch_model=False)
    return per_gpu(w, anchor.setup)


def accelerator(anchor: Anchor):
    acc = load_catalog().get(anchor.gpu)
    return dataclasses.replace(acc, memory_bytes=anchor.memory_gib * GiB) if anchor.memory_gib else acc


def predict(anchor: Anchor, step=None) -> float:
    """Predicted tokens/s per GPU."""
    step = step or step_of(anchor)
    t = costmodel.step_time(step, accelerator(anchor))
    return step.workload.tokens_per_step / t.seconds


def error(predicted: float, measured: float) -> float:
    return predicted / measured - 1


def main() -> int:
    t0 = time.perf_counter()
    steps = {a.id: step_of(a) for a in ANCHORS}
    capture_s = time.perf_counter() - t0
    print(f"{'#':>3}  {'anchor':<48} {'set':<8} {'measured':>9} {'predicted':>9} {'error':>7}  MFU")
    errs = {"fit": [], "held out": []}
    for a in ANCHORS:
        t = costmodel.step_time(steps[a.id], accelerator(a))
        p = steps[a.id].workload.tokens_per_step / t.seconds
        e = error(p, a.measured_tok_s_per_gpu)
        group = "fit" if any(a.id in ids for ids in FIT.values()) else "held out"
        errs[group].append(abs(e))
        print(f"{a.id:>3}  {a.what:<48} {group:<8} {a.measured_tok_s_per_gpu:>9,.0f} {p:>9,.0f} {e:>+7.1%}  "
              f"{t.mfu:.2f} (comm {t.comm_s * 1e3:.0f} ms, exposed {t.exposed_comm_s * 1e3:.0f} ms)")
    for group, e in errs.items():
        print(f"{group}: median |error| {statistics.median(e):.1%}, worst {max(e):.1%}")
    print(f"captures {capture_s:.1f} s; python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
