"""One serving replica over ``tp x pp`` GPUs, as a runtime lays it out: its sequences that fit, and its load.

Layouts (``Layout.split``): ``tp`` tensor parallel (vLLM, SGLang, TensorRT-LLM: every matrix split, two all-reduces
a layer at the runtime's custom all-reduce latency over peer links, else NCCL's measured tables); ``row``
llama.cpp's ``--split-mode row`` (the same split, its partial results gathered through the host: NCCL's latency);
``pp`` pipeline stages with micro-batches in flight (vLLM/SGLang/TRT ``--pipeline-parallel-size``); ``layer``
llama.cpp's default ``--split-mode layer`` and transformers' ``device_map="auto"``: each GPU a run of layers, one GPU
busy at a time.

>>> Layout(split="layer", gpus=2).pp, Layout(split="tp", gpus=4).tp
(2, 4)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import Accelerator
from gpuwise.planning.cost.comm import collective_seconds, intra_link
from gpuwise.planning.cost.llm_step import LlmShape, StepCost, step_seconds
from gpuwise.planning.cost.load import Load, serve_load
from gpuwise.planning.cost.runtimes import Runtime

# Under this a collective is latency: the small all-reduce of a decode step's hidden states
_SMALL = 8192.0


@dataclass(frozen=True, kw_only=True)
class Layout:
    split: str  # "tp", "row", "pp", "layer" (the module docstring)
    gpus: int

    @property
    def tp(self) -> int:
        return self.gpus if self.split in ("tp", "row") else 1

    @property
    def pp(self) -> int:
        return self.gpus if self.split in ("pp", "layer") else 1

    def describe(self) -> str:
        if self.gpus == 1:
            return "one GPU"
        return {"tp": f"tensor parallel over {self.gpus}", "row": f"llama.cpp row split over {self.gpus}",
                "pp": f"pipeline parallel over {self.gpus}",
                "layer": f"layer split over {self.gpus} (one GPU busy at a time)"}[self.split]


def layouts(rt: Runtime, gpus: int) -> tuple[Layout, ...]:
    """The layouts ``rt`` can spread one replica over ``gpus`` GPUs with."""
    if gpus == 1:
        return (Layout(split="tp", gpus=1),)
    names = {"tp": ("tp",), "pp": ("pp",), "layer": ("layer",), "row": ("row",)}
    return tuple(Layout(split=s, gpus=gpus) for split in rt.splits for s in names[split])


def allreduce(acc: Accelerator, rt: Runtime, layout: Layout) -> tuple[tuple[float, float] | None, str]:
    """(latency s, bytes/s) of one all-reduce between the replica's tensor-parallel GPUs, and its basis; None: no
    link."""
    n = layout.tp
    if n == 1:
        return (0.0, math.inf), ""
    small = collective_seconds("all-reduce", _SMALL, n, acc, dtype="bf16")
    big = collective_seconds("all-reduce", 2.0**26, n, acc, dtype="bf16")
    if small is None or big is None:
        return None, f"no known link between {n} of these"
    link = intra_link(acc, n)
    peer = link is not None and link.kind in ("switch", "mesh", "measured") and acc.peer_link
    rate = big.busbw_gbps * 1e9
    if layout.split == "tp" and peer and rt.fast_allreduce_s is not None:
        return (rt.fast_allreduce_s, rate), (f"{rt.name}'s custom all-reduce over the peer link "
                                             f"({rt.fast_allreduce_s * 1e6:.0f} us), {big.busbw_gbps:.0f} GB/s")
    return (small.seconds, rate), f"NCCL all-reduce {small.seconds * 1e6:.0f} us ({small.source})"


def handoff(acc: Accelerator, layout: Layout, hidden: int, tokens: float) -> float:
    """A stage's activations to the next GPU (a send of tokens x hidden 16-bit values)."""
    if layout.pp == 1:
        return 0.0
    got = collective_seconds("send/recv", max(tokens, 1.0) * hidden * 2, 2, acc, dtype="bf16")
    return 0.0 if got is None else got.seconds


def capacity(acc: Accelerator, layout: Layout, *, weight_bytes: float, activation_bytes: float,
             kv_bytes_per_seq: float, share: float, kv_block: int, context: int) -> int:
    """Sequences at the full ``context`` one replica holds: each GPU's ``share`` of memory less its weights and
    activations, over its part of a sequence's cache (whole ``kv_block``-token blocks): serving.max_concurrency
    on one GPU of the layout."""
    from gpuwise.planning.cost.serving import max_concurrency

    per_gpu_kv = kv_bytes_per_seq / layout.pp
    padded = per_gpu_kv * math.ceil(context / kv_block) * kv_block / context
    return max_concurrency(acc, weight_bytes=weight_bytes / layout.gpus, kv_bytes_per_sequence=padded,
                           activation_bytes=activation_bytes, utilization=share)


def replica_load(shape: LlmShape, acc: Accelerator, rt: Runtime, layout: Layout, *, weights: str, prompt: int,
                 output: int, seqs: int, concurrency: float | None = None, rate: float | None = None,
                 burst: int | None = None, expert_read=None,
                 calibration: Calibration | None = None) -> tuple[Load | None, str]:
    """The replica's load (cost/load.py) with at most ``seqs`` sequences at once; (None, why) where it cannot be
    priced. ``expert_read(tokens)``: a MoE's weights a step of that many tokens reads, over one token's."""
    comm, comm_basis = allreduce(acc, rt, layout)
    if comm is None:
        return None, comm_basis
    share = 1.0 / layout.pp
    mean_context = prompt + output / 2

    def step(decode: float, prefill: float, prefill_seqs: float) -> StepCost:
        er = expert_read(decode + prefill) if expert_read is not None else 1.0
        got = step_seconds(shape, acc, rt, decode=decode, context=mean_context, prefill=prefill,
                           prefill_seqs=prefill_seqs, weights=weights, tp=layout.tp, layer_share=share, expert_read=er,
                           comm=comm, row=layout.split == "row", host_share=1.0 if layout.split == "pp" else None,
                           calibration=calibration)
        assert got is not None  # checked by the caller: the chip has the kernel model's facts
        return got

    hop = handoff(acc, layout, shape.hidden, min(seqs, concurrency or seqs))
    load = serve_load(step, rt, prompt=prompt, output=output, capacity=seqs, concurrency=concurrency, rate=rate,
                      burst=burst, pp=layout.pp, handoff_s=hop)
    return load, comm_basis


def model_shape(planner, dims, *, context: int, kv_dtype: str | None = None, fallback=None, kv=None):
    """(llm_step.LlmShape, kv_cache.SequenceKV) of a model from its captured decode step at ``context`` cached tokens
    (one sequence, bf16): ``plan --task decode``'s capture. ``fallback``: a captured inference step to read the
    kernels from where the decode step cannot be captured; ``kv``: the cache at ``context`` where it is known."""
    from gpuwise.errors import GpuwiseError, NotApplicable
    from gpuwise.planning.cost.kv_cache import sequence_kv
    from gpuwise.planning.setup import Setup

    kv = kv or sequence_kv(planner, dims, context=max(context, 2), kv_dtype=kv_dtype)
    try:
        step = planner.per_gpu(Setup(task="decode", micro_batch=1, context=max(context - 1, 1), precision="bf16",
                                     kv_dtype=kv_dtype))
    except (GpuwiseError, NotApplicable):
        if fallback is None:
            raise
        step = fallback
    return LlmShape.of(step, dims, kv_bytes=kv.bytes), kv


def stream_tokens_per_s(shape: LlmShape, acc: Accelerator, rt: Runtime, *, weights: str, output: int,
                        layout: Layout | None = None, calibration: Calibration | None = None) -> float | None:
    """One stream's decode speed over a cache ``shape`` was captured at (llama-bench's tgN: the prompt, if any, is
    not timed). None: the chip lacks the kernel model's facts or the GPUs a link."""
    layout = layout or Layout(split="tp", gpus=1)
    comm, _ = allreduce(acc, rt, layout)
    if comm is None or step_seconds(shape, acc, rt, decode=1, context=shape.context, weights=weights) is None:
        return None
    context = shape.context

    def step(decode: float, prefill: float, prefill_seqs: float) -> StepCost:
        return step_seconds(shape, acc, rt, decode=decode, context=context, prefill=prefill,
                            prefill_seqs=prefill_seqs, weights=weights, tp=layout.tp, layer_share=1 / layout.pp,
                            comm=comm, row=layout.split == "row", calibration=calibration)

    hop = handoff(acc, layout, shape.hidden, 1)
    return serve_load(step, rt, prompt=0, output=output, capacity=1, concurrency=1, pp=layout.pp,
                      handoff_s=hop).decode_tokens_per_s
