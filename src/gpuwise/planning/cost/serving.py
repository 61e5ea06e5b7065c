"""What a decode step reads and how many sequences fit: the pieces of serving that are not time. The time of a
serving step is llm_step's (kernels priced from per-op measurements, the runtime's constants: runtimes.py), under
load load.py's, over GPUs replica.py's.

KV(S) = 2 x layers x kv_heads x head_dim x S x bytes (PagedAttention §3.1, as quoted in vllm#22291). ``roofline`` is
the plan's per-token floor (``gpuwise plan --task decode``): what a captured step reads at the datasheet's bandwidth,
or its FLOPs at the matmul peak, whichever takes longer.

A Mixture of Experts holds every expert in memory but a step reads only the experts its tokens are routed to
(``moe_weights_read``): at batch 1 the active weights (the dense ones and ``top_k`` of ``E`` experts a MoE layer),
at batch B the experts B tokens touch, ``E (1 - (1 - k/E)^B)`` a layer in expectation under uniform routing, so a
full batch reads (nearly) all of them. Its FLOPs stay ``2 x N_active`` a token at any batch.

>>> kv_bytes_per_token(layers=32, kv_heads=32, head_dim=128)    # Llama-2-7B, fp16 cache
524288
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import Accelerator
from gpuwise.planning.capture.tracker import CATEGORIES

if TYPE_CHECKING:
    from gpuwise.planning.parallel.sharding import PerGpu

@dataclass(frozen=True, kw_only=True)
class DecodeRead:
    """What one decode step reads, from its capture (``gpuwise plan --task decode``): every stored weight once but
    the rows of an untied embedding no sequence looks up (each reads one row of it; a tied one is read whole as the
    head) and, in a Mixture of Experts, the routed experts none of the batch's B tokens picks (a share
    ``(1 - k/E)^B`` of them under uniform routing, ``UNIFORM_ROUTING``, of the bytes the experts are stored in:
    ``Workload.expert_bytes``), and every sequence's KV cache (the N
    cached tokens and the new one); its FLOPs (matmuls, and attention over the cache).
    """

    weight_bytes: int
    kv_cache_bytes: int
    flops: int
    context: int  # tokens cached before the step
    batch: int  # sequences, one new token each
    weights: str | None = None  # --weights: int8 and fp8 multiply at their own rate (W8A8)
    # one sequence's cache (context + 1 tokens): THE figure recommend --serve sizes its concurrency with (kv_cache.py)
    kv_bytes_per_seq: int = 0

    @property
    def bytes_read(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes

    @classmethod
    def of(cls, step: PerGpu) -> DecodeRead:
        """From a captured decode step: its live bytes by category at the end of the forward (the cache holds the
        N + 1 tokens by then, and nothing but the weights and the cache is read whole)."""
        at = step.live[step.timeline.end_of_forward]
        b = step.setup.micro_batch
        w = step.workload
        unread = sum(max(rows - b, 0) * row for rows, row in w.embeddings)  # positions: <= b rows read
        weights = int(at[CATEGORIES.index("weights")])
        if w.routed is not None and w.expert_bytes:
            experts, top_k = w.routed
            untouched = experts - experts_touched(experts, top_k, b)  # expected, of each layer's E
            unread += int(w.expert_bytes * untouched / experts)
        kv = int(at[CATEGORIES.index("kv_cache")])
        return cls(weight_bytes=weights - unread, weights=step.setup.weights, kv_cache_bytes=kv,
                   flops=step.workload.flops_per_step, context=step.setup.context or 0, batch=b,
                   kv_bytes_per_seq=kv // b)


@dataclass(frozen=True, kw_only=True)
class TokenFloor:
    seconds: float  # one decode step: every sequence gets one token
    bound: str  # "memory" or "compute"
    basis: str


def roofline(*, bytes_read: float, flops: float, bytes_per_s: float, flops_per_s: float | None) -> tuple[float, str]:
    """THE decode-step decision, for the plan's floor and the serving estimate alike: the bytes the step reads at
    the bandwidth, or its FLOPs at the matmul rate, whichever takes longer."""
    memory_s = bytes_read / bytes_per_s
    compute_s = flops / flops_per_s if flops_per_s else 0.0
    return max(memory_s, compute_s), "compute" if compute_s > memory_s else "memory"


def decode_floor(acc: Accelerator, read: DecodeRead, *, calibration: Calibration | None = None) -> TokenFloor | None:
    """The per-token latency floor of a captured decode step on ``acc``: bytes read / bandwidth or FLOPs / the matmul
    peak (16-bit; int8's or fp8's for those weights, ``_rate``), whichever is larger, at the datasheet's figures
    (or gpuwise bench --calibrate's). None: no bandwidth."""
    gbps = (calibration.gbps if calibration is not None else None) or acc.memory_bandwidth_gbps
    if not gbps:
        return None
    key, tflops, measured = _rate(acc, calibration, read.weights)
    seconds, bound = roofline(bytes_read=read.bytes_read, flops=read.flops, bytes_per_s=gbps * 1e9,
                              flops_per_s=tflops * 1e12 if tflops else None)
    basis = (f"{read.bytes_read / 2**30:.2f} GiB read ({read.weight_bytes / 2**30:.2f} weights + "
             f"{read.kv_cache_bytes / 2**30:.2f} KV cache) / {gbps:g} GB/s"
             f"{' measured' if calibration is not None and calibration.gbps else ''}")
    if tflops:
        basis += f" · {read.flops:.3g} FLOPs / {key} {tflops:g} TFLOPS{' measured' if measured else ''}"
    return TokenFloor(seconds=seconds, bound=bound, basis=basis)


# The routing the decode model assumes for a Mixture of Experts (moe_weights_read)
UNIFORM_ROUTING = ("uniform routing: each token picks its top-k of the E experts of a MoE layer, every expert as "
                   "likely (the balanced load the auxiliary loss trains for: Fedus et al. 2021, Switch Transformer "
                   "§2.2), independently of the other tokens")


def experts_touched(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts of one MoE layer that ``tokens`` tokens are routed to, under uniform routing: a
    token picks ``top_k`` of ``experts``, so it misses a given expert with probability ``1 - k/E``, and ``B``
    independent tokens all miss it with ``(1 - k/E)^B``: ``E (1 - (1 - k/E)^B)`` (the occupancy expectation).

    >>> experts_touched(8, 2, 1), round(experts_touched(8, 2, 16), 2)    # Mixtral: 2 at batch 1, ~all at 16
    (2.0, 7.92)
    """
    _positive(experts=experts, top_k=top_k, tokens=tokens)
    if top_k > experts:
        raise GpuwiseError(f"top_k {top_k} is more than experts {experts}", "pass top_k <= experts")
    return experts * (1 - (1 - top_k / experts) ** tokens)


def moe_weights_read(params: float, active_params: float, *, experts: int, top_k: int, tokens: int) -> float:
    """Parameters one forward of ``tokens`` tokens reads (a decode step at batch B reads B tokens, a prefill its
    prompt), under uniform routing (``UNIFORM_ROUTING``): the dense ones (attention, norms, routers, shared experts,
    embeddings) and the routed experts touched, ``experts_touched / E`` of the routed ``R``. Mixtral-style counts
    give ``R`` from the total and the active: ``N - N_active = R (E - k) / E`` (experts.Experts.active), so

        read(B) = N - R (1 - k/E)^B = N - (N - N_active) (1 - k/E)^(B - 1)

    N_active at batch 1, N as B grows (Mixtral, 46.7 B / 12.9 B: 21.4 B at batch 2, 46.2 B at batch 16).
    All MoE layers alike (the same E and k: every MoE model transformers ships).

    >>> round(moe_weights_read(46.7e9, 12.9e9, experts=8, top_k=2, tokens=2) / 1e9, 2)
    21.35
    """
    _positive(params=params, active_params=active_params, tokens=tokens)
    if active_params > params:
        raise GpuwiseError(f"active_params {active_params:g} is more than params {params:g}", "pass active <= total")
    if experts_touched(experts, top_k, 1) == experts:  # k = E: every expert runs for every token (dense)
        return params
    return params - (params - active_params) * (1 - top_k / experts) ** (tokens - 1)


def kv_bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, kv_bytes: float = 2, latent: int = 0) -> int:
    """K and V of every layer for one token: 2 x layers x kv_heads x head_dim x bytes; under multi-head latent
    attention (``latent``: Decoder.kv_latent, kv_lora_rank + qk_rope_head_dim) layers x latent x bytes, what
    transformers 5 and vLLM both cache (DeepSeek-V3: 61 x 576 x 2 = 70,272 B, not 2 x 61 x 128 heads x 56)."""
    _positive(layers=layers, kv_heads=kv_heads, head_dim=head_dim, kv_bytes=kv_bytes)
    if latent:
        return int(layers * latent * kv_bytes)
    return int(2 * layers * kv_heads * head_dim * kv_bytes)


def max_concurrency(acc: Accelerator, *, weight_bytes: float, kv_bytes_per_sequence: float,
                    activation_bytes: float = 0, utilization: float = 0.9) -> int:
    """Sequences whose KV cache fits: floor((memory x utilization - weights - activations) / KV per sequence),
    vLLM's sizing (gpu_memory_utilization 0.9 by default, v1/core/kv_cache_utils.py). 0: not even one."""
    _positive(weight_bytes=weight_bytes, kv_bytes_per_sequence=kv_bytes_per_sequence, utilization=utilization)
    if utilization > 1:
        raise GpuwiseError(f"utilization {utilization} is above 1", "pass a share of memory, e.g. 0.9")
    free = acc.memory_bytes * utilization - weight_bytes - activation_bytes
    return max(0, math.floor(free / kv_bytes_per_sequence))


def _positive(**values: float) -> None:
    for name, v in values.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or not math.isfinite(v):
            raise GpuwiseError(f"{name} {v!r} is not a positive number", f"pass {name} > 0")


def _rate(acc: Accelerator, calibration: Calibration | None, quant: str | None = None
          ) -> tuple[str, float | None, bool]:
    """The matmul rate of a decode step: int8 and fp8 weights multiply in their own format (W8A8: LLM.int8's
    int8 GEMM, vLLM's fp8 ``_scaled_mm``) where the GPU has that rate; weight-only formats (int4, nf4) and 16-bit
    weights compute in 16 bits: the bf16 rate, else fp16, else fp32."""
    own = (quant,) if quant in ("int8", "fp8") else ()
    for key in (*own, "bf16", "fp16", "fp32"):
        measured = calibration.tflops.get(key) if calibration is not None else None
        if measured or acc.peak_tflops.get(key):
            return key, measured or acc.peak_tflops.get(key), bool(measured)
    return "bf16", None, False
