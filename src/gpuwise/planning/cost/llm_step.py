"""One serving step of a decoder on one GPU, priced kernel by kernel from the same measured per-op data as training
(cost/kernels.py), for any mix of decode tokens and prompt tokens (continuous batching puts both in one step).

The model's own kernels come from its captured decode step (``gpuwise plan --task decode``, one sequence): its
linear layers as GEMMs (n, k) and their counts, its attention layers over the cache (heads, keys, head dim: a
sliding window shows as fewer keys), and the rest of its ops (norms, rotary, activations, copies). A step of ``d``
decode tokens and ``p`` prompt tokens then costs

- each linear layer once at M = d + p rows: the larger of streaming its weights (stored bytes: a quantised format's
  bits) at the bandwidth NeuSight's streaming kernels reach (0.81 of the datasheet, kernels.memory_rows) times the
  runtime's kernel share (``Runtime.stream``), and the tile model's compute at M rows (OpenXLA-fitted tensor
  tiles);
- attention: the ``d`` sequences' caches read (memory-bound; bytes at the streaming rate), the prompt's causal
  FLOPs at FlashAttention's utilisation (kernels.attention_efficiency);
- the other kernels: their bytes per token at the elementwise rate; each kernel launch: a CUDA-graph replay's GPU
  floor (vLLM, SGLang, TensorRT-LLM, llama.cpp), or eager PyTorch's measured host dispatch (hf), whichever is longer
  than the GPU's work;
- the runtime's host time per step and per sequence (runtimes.Runtime.step_s, seq_s; fitted, see there);
- tensor parallel: two all-reduces of the step's hidden states a layer (Megatron), at the runtime's custom
  all-reduce latency over peer links or NCCL's measured tables (cost/comm.py).

>>> shape = LlmShape.of(planner.per_gpu(Setup(task="decode", context=1023)), decoder)    # doctest: +SKIP
>>> step_seconds(shape, acc, RUNTIMES["vllm"], decode=32, context=1024).seconds          # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import MappingProxyType

import numpy as np

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import Accelerator
from gpuwise.planning.capture.tracker import FAMILIES, PHASES
from gpuwise.planning.cost import kernels
from gpuwise.planning.cost.gemm import gemm_seconds
from gpuwise.planning.cost.runtimes import FP4_ARCHS, FP4_BITS, GGUF_BITS, Runtime
from gpuwise.planning.transforms.quantize import FORMATS

_MM, _ATTN, _BMM = FAMILIES.index("matmul"), FAMILIES.index("attention"), FAMILIES.index("bmm")
_FWD = PHASES.index("forward")
_MEMORY = tuple(FAMILIES.index(f) for f in ("elementwise", "norm", "softmax", "reduction", "copy"))
# Bytes of a stored weight per format, THE table (recommend --serve's --weights): 16-bit formats and fp32 as
# computed; the formats plan simulates as transforms/quantize.py lays them out (for a 4096 x 4096 layer: int4 as AWQ
# group 128 ~0.52, nf4 with double quantisation 4.127 bits, QLoRA §2; int8 and fp8 1 B plus their scales); GGUF's
# types and FP4 by their bits (runtimes.GGUF_BITS, FP4_BITS).
WEIGHT_BYTES = MappingProxyType({"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "f16": 2.0,
                                 **{k: f.bytes_per_weight() for k, f in FORMATS.items()},
                                 **{k: b / 8 for k, b in GGUF_BITS.items()}, **{k: b / 8 for k, b in FP4_BITS.items()}})
QUANTISED = ("int8", "int4", "nf4", *GGUF_BITS, *FP4_BITS)
SKINNY_ROWS = 16  # the M a small-batch GEMM kernel pads to (CUTLASS/Marlin m16 MMA tiles); fewer rows: GEMV kernels


def weight_itemsize(weights: str) -> float:
    """Bytes a weight of the blocks' linear layers takes stored as ``weights``."""
    if weights not in WEIGHT_BYTES:
        raise GpuwiseError(f"unknown weight format {weights!r}", f"use one of {', '.join(WEIGHT_BYTES)}")
    return WEIGHT_BYTES[weights]


@dataclass(frozen=True, kw_only=True)
class LlmShape:
    """What a step costs depends on, read off one captured decode step (batch 1): the model on one GPU."""

    gemms: np.ndarray  # (rows, 3): n, k, count of each linear layer shape (the head included) a token runs
    experts: np.ndarray  # (rows,) bool: a MoE's routed experts (count: the top_k a token runs, all layers)
    expert_share: float = 1.0  # top_k / E: the experts a token runs of those held
    head: tuple[int, int]  # the output head's (n, k): run once per sequence that samples, not per prompt token
    attention: np.ndarray  # (rows, 4): heads, keys (at the captured context), head dim, count
    context: int  # the captured step's cached tokens
    kv_bytes: float  # one sequence's cache at ``context`` (as stored in the capture's dtype)
    other_bytes: float  # the other kernels' bytes per token
    cache_copy_bytes: float  # a sequence's cache copied each step at ``context`` (eager transformers), else 0
    other_kernels: float  # the other kernels per token step (eager launches)
    other_dispatch_s: float  # eager host dispatch of every kernel of the step (hf), measured per family
    layers: int
    hidden: int  # the residual stream's width (the tensor-parallel all-reduce)

    @classmethod
    def of(cls, step, dims, *, kv_bytes: float) -> LlmShape:
        """From a captured decode step (``PerGpu`` of ``Setup(task="decode", micro_batch=1)``; or, for a model whose
        decode step cannot be captured, its inference step of one sequence), the decoder's dims (sources.base.Decoder)
        and one sequence's cache at the step's context (kv_cache.SequenceKV.bytes)."""
        c = step.workload.costs
        fwd = c.phase == _FWD
        tokens = 1 if step.setup.task == "decode" else (step.setup.seq or 1) * step.setup.micro_batch
        mm = fwd & (c.family == _MM) & (c.dims[:, 0] * c.dims[:, 1] == tokens)  # the linear layers
        gemms = np.stack([c.dims[mm, 2], c.dims[mm, 3], c.count[mm]], axis=1) if mm.any() else np.zeros((0, 3))
        experts = np.zeros(len(gemms), bool)
        routed = step.workload.routed
        if routed is not None:  # a MoE layer's experts as one batched GEMM over all E (transformers' fused experts):
            e, top_k = routed  # a token runs top_k of them
            ex = fwd & (c.family == _BMM) & (c.dims[:, 0] == e) & (c.dims[:, 1] == tokens)
            if ex.any():
                rows = np.stack([c.dims[ex, 2], c.dims[ex, 3], c.count[ex] * top_k], axis=1)
                gemms = np.concatenate([gemms, rows])
                experts = np.concatenate([experts, np.ones(len(rows), bool)])
        vocab = max((rows for rows, _ in step.workload.embeddings), default=0)
        head_rows = np.flatnonzero(np.isclose(gemms[:, 0], vocab)) if vocab else np.array([], int)
        head = (int(gemms[head_rows[0], 0]), int(gemms[head_rows[0], 1])) if len(head_rows) else (0, 0)
        att = fwd & np.isin(c.family, (_ATTN, _BMM))
        attention = np.stack([c.dims[att, 0], c.dims[att, 2], c.dims[att, 3], c.count[att]], axis=1)
        if not (c.family[att] == _ATTN).any() and att.any():  # eager: two bmm a layer; keep q @ k^T's
            attention = attention[: max(1, len(attention) // 2)]
        mem = fwd & np.isin(c.family, _MEMORY)
        table = sum((rows * row for rows, row in step.workload.embeddings), 0)
        keep = mem & (c.bytes < max(table, 1) * 0.5 if table else mem)  # the embedding lookup reads one row
        # copies as large as a layer's cache: transformers' DynamicCache concatenating it each step (per sequence,
        # growing with the context), not per token
        layer_kv = kv_bytes / max(float(attention[:, 3].sum()) if len(attention) else 1.0, 1.0)
        cache = keep & (c.bytes >= 0.5 * layer_kv) if tokens == 1 else np.zeros(len(c.bytes), bool)
        keep = keep & ~cache
        if tokens > 1 and len(attention):  # a prompt's attention: its keys are the prompt's tokens
            attention[:, 1] = np.minimum(attention[:, 1], tokens)
        context = int(step.setup.context or 1) if tokens == 1 else tokens
        share = routed[1] / routed[0] if routed is not None and experts.any() else 1.0
        return cls(gemms=gemms, experts=experts, expert_share=share, head=head, attention=attention, context=context,
                   kv_bytes=float(kv_bytes), other_bytes=float(c.bytes[keep] @ c.count[keep]) / tokens,
                   cache_copy_bytes=float(c.bytes[cache] @ c.count[cache]),
                   other_kernels=float(c.count[mem].sum()),
                   other_dispatch_s=float(kernels.forward_dispatch(c.family[fwd]) @ c.count[fwd]),
                   layers=dims.layers, hidden=dims.heads * dims.head_dim)

    def weights_read(self, weights: str, *, expert_read: float = 1.0) -> float:
        """Bytes of weights one step reads on one GPU of the model (all of it): every linear layer once, a MoE's
        experts as many as the step's tokens touch (``expert_read`` over the top_k one token runs); the input
        embedding is a row a token (not counted)."""
        g = self.gemms
        if not len(g):
            return 0.0
        share = np.where(self.experts, expert_read, 1.0)
        return float((g[:, 0] * g[:, 1] * g[:, 2] * share).sum()) * weight_itemsize(weights)

    def weights_held(self, weights: str, params: float) -> float:
        """Bytes of a model of ``params`` parameters held on one GPU: its linear layers (every expert) stored as
        ``weights``, the rest (embeddings, norms) in 16 bits, as quantize.py keeps them."""
        linear = min(self.held_linear_params, params)
        return linear * weight_itemsize(weights) + (params - linear) * 2.0

    @property
    def held_linear_params(self) -> float:
        """Parameters of the linear layers held (every expert of a MoE)."""
        g = self.gemms
        if not len(g):
            return 0.0
        return float(g[:, 0] * g[:, 1] @ (g[:, 2] / np.where(self.experts, self.expert_share, 1.0)))

    @property
    def linear_params(self) -> float:
        return float(self.gemms[:, 0] @ (self.gemms[:, 1] * self.gemms[:, 2])) if len(self.gemms) else 0.0


@dataclass(frozen=True, kw_only=True)
class StepCost:
    seconds: float
    gemm_s: float
    attention_s: float
    other_s: float
    host_s: float  # the runtime's host time the GPU waits for (and eager dispatch beyond the GPU's work)
    comm_s: float
    bound: str  # "memory", "compute", "host" or "communication": the largest part


def _rate_code(acc: Accelerator, weights: str) -> int:
    """The precision the GEMMs multiply in: fp8 weights (and FP4 on Blackwell, at fp8's rate here) on fp8 tensor
    cores where the chip has them; everything else dequantises to 16 bits."""
    if acc.fp8 and (weights == "fp8" or weights in FP4_BITS):
        return kernels.RATE_KEYS.index("fp8")
    return kernels.RATE_KEYS.index("bf16" if acc.peak_tflops.get("bf16") else "fp16")


def chip_of(acc: Accelerator) -> kernels.Chip | None:
    """The kernel model's chip; for a row without SM and clock facts (Apple's unified-memory GPUs) one built from
    its rates and bandwidth alone: 64 units at 1 GHz sharing the fp32 rate (the tile model then only pads), its
    16-bit rate as the tensor rate. None: no bandwidth or no rate."""
    chip = kernels.Chip.of(acc)
    if chip is not None:
        return chip
    rates = {k: float(v) for k in ("fp32", "fp16", "bf16") if (v := acc.peak_tflops.get(k))}
    if not acc.memory_bandwidth_gbps or not rates:
        return None
    fp32 = rates.get("fp32") or max(rates.values()) / 2
    return kernels.Chip(name=acc.key, arch=(acc.arch or "other").split()[0], die=None, compute_capability=None,
                        sms=64, boost_clock_mhz=1000.0, base_clock_mhz=None, fp32_tflops=fp32,
                        tensor_tflops={k: v for k, v in rates.items() if k != "fp32"} or {"fp16": fp32},
                        bandwidth_gbps=float(acc.memory_bandwidth_gbps), l2_mib=None, tdp_w=acc.tdp_w,
                        memory_class="unified", vendor=acc.vendor, segment=acc.segment)


def fp4_capable(acc: Accelerator) -> bool:
    return acc.arch.split()[0] in FP4_ARCHS if acc.arch else False


def step_seconds(shape: LlmShape, acc: Accelerator, rt: Runtime, *, decode: float, context: float,
                 prefill: float = 0.0, prefill_seqs: float = 0.0, weights: str = "bf16", tp: int = 1,
                 layer_share: float = 1.0,
                 expert_read: float = 1.0, comm: tuple[float, float] | None = None, row: bool = False,
                 host_share: float | None = None, calibration: Calibration | None = None) -> StepCost | None:
    """One step on one GPU of a replica: ``decode`` sequences one token each at mean ``context`` cached tokens, and
    ``prefill`` prompt tokens (of ``prefill_seqs`` whole prompts: each attends to half its length on average). ``tp``:
    tensor parallel degree (GEMM widths, attention heads and cache split over the GPUs); ``layer_share``: the share
    of the layers this GPU runs (pipeline / layer split); the cache is the one ``shape`` was read with (its
    --kv-dtype); ``expert_read``: a MoE's weights a step reads over those one token reads; ``comm``: (latency s,
    bytes/s) of one all-reduce between the tensor-parallel GPUs; ``row``: llama.cpp's row split instead, which
    gathers every split matrix's partial output (fp32) on the main GPU and synchronises (``Runtime.row_sync_s``
    each, the bytes at ``comm``'s rate). None: the chip lacks what the kernel model needs."""
    chip = chip_of(acc)
    if chip is None:
        return None
    fit = kernels.load_fit()
    tokens = decode + prefill
    m = max(tokens, 1.0)
    code = _rate_code(acc, weights)
    wbytes = weight_itemsize(weights)
    mem = fit.memory["elementwise"]
    bw = (calibration.gbps if calibration is not None and calibration.gbps else chip.bandwidth_gbps) * 1e9
    stream_bw = bw * mem.dram_share * (rt.quant_stream if weights in QUANTISED else rt.stream)
    if chip.memory_class == "HBM":
        stream_bw *= rt.hbm_stream
    # linear layers: the head runs for the sequences that sample (decode ones, and prompts that finish in the step)
    g = shape.gemms
    gemm_s, compute_bound = 0.0, False
    if len(g):
        n = np.maximum(g[:, 0] / tp, 1.0)
        k = g[:, 1]
        is_head = (g[:, 0] == shape.head[0]) & (g[:, 1] == shape.head[1]) if shape.head[0] else np.zeros(len(g), bool)
        rows = np.where(is_head, max(decode + prefill_seqs, 1.0), m)
        count = g[:, 2] * np.where(is_head, 1.0, layer_share)
        hw, _ = kernels.hardware(chip, code, fit)
        compute_only = replace(hw, bw=math.inf, l2_bw=math.inf)  # the memory side is the streaming term below
        tiled = gemm_seconds(np.ones(len(g)), np.ceil(rows), n, k, tiles=kernels.TENSOR_TILES, fit=fit.tensor,
                             hw=compute_only, in_bytes=2.0, out_bytes=2.0)
        # a few rows: the skinny kernels (GEMV, Marlin, mmvq) pad M to 16 at most, at the best tile's utilisation
        padded = np.where(rows < SKINNY_ROWS, rows, np.ceil(rows / SKINNY_ROWS) * SKINNY_ROWS)  # GEMV: no padding
        skinny = 2 * padded * n * k / (hw.sm_flops * hw.sms * max(fit.tensor.eff))
        compute = np.minimum(tiled, skinny) * kernels.tensor_ceiling(chip, fit)
        if rt.legacy_mma and chip.arch in ("Hopper", "Blackwell"):
            # Ampere-style mma.sync kernels on Hopper/Blackwell reach what FlashAttention-2 does there against
            # Ampere (FA3 paper: 35% of H100 vs 65-73% of A100 peak): the warp-group MMA peak is out of reach
            compute = compute * kernels.ATTENTION_EFFICIENCY["flash"] / kernels.ATTENTION_EFFICIENCY["flash-hopper"]
        if weights in FP4_BITS and fp4_capable(acc):  # FP4 tensor cores: twice fp8's rate (Blackwell datasheets)
            compute = compute / 2
        elif weights in QUANTISED and rt.int8_mma and chip.vendor != "NVIDIA":
            compute = compute / rt.compute  # Metal, ROCm, Vulkan: dequantised to 16 bits for the prompt's matmuls
        elif weights in QUANTISED:  # dequantising GEMM kernels (Marlin, llama.cpp's mmq) at their share of the rate
            int8 = acc.peak_tflops.get("int8")
            sixteen = chip.tensor_tflops.get(kernels.RATE_KEYS[code])
            if rt.int8_mma and int8 and sixteen:  # mmq multiplies the quantised blocks on int8 tensor cores
                compute = compute * sixteen / int8
            compute = compute / rt.quant_compute
        else:
            compute = compute / rt.compute
        read = n * k * wbytes * np.where(shape.experts, expert_read, 1.0) + 2.0 * rows * (n + k)
        gemm_s = float((np.maximum(compute, read / stream_bw) + kernels.LAUNCH_FLOOR_S) @ count)
        compute_bound = float(compute @ count) > float((read / stream_bw) @ count)
    # attention: decode reads each sequence's cache; a prompt's tokens attend causally to what precedes them
    a = shape.attention
    attention_s = 0.0
    if len(a):
        heads = np.maximum(np.ceil(a[:, 0] / tp), 1.0)
        window = np.where(a[:, 1] < shape.context, a[:, 1], np.inf)  # a sliding window holds fewer keys
        keys = np.minimum(context, window)
        per_key = shape.kv_bytes / max(float(a[:, 1] @ a[:, 3]), 1.0)  # one cached token of one layer, all heads
        kv_read = decode * per_key * float(keys @ a[:, 3]) / max(tp, 1)
        attention_s += kv_read * layer_share / (bw * mem.dram_share)
        if prefill:
            pkeys = np.minimum(prefill / max(prefill_seqs, 1.0) / 2, window)
            flops = 4 * heads * a[:, 2] * prefill * pkeys
            hw, _ = kernels.hardware(chip, kernels.RATE_KEYS.index("bf16") if chip.tensor_tflops.get("bf16")
                                     else kernels.RATE_KEYS.index("fp16"), fit)
            eff = kernels.attention_efficiency("flash", chip, pkeys)
            attention_s += float((flops / (hw.sm_flops * hw.sms * np.maximum(eff, 1e-3))) @ a[:, 3]) * layer_share
        attention_s += kernels.LAUNCH_FLOOR_S * float(a[:, 3].sum()) * layer_share
    # the other kernels: their bytes a token, fused where the runtime fuses them
    other_bytes = shape.other_bytes * m * layer_share / tp
    fused = rt.kernels_per_layer > 0
    launches = (rt.kernels_per_layer * shape.layers if fused else shape.other_kernels) * layer_share
    other_s = float(other_bytes * (0.3 if fused else 1.0) / (bw * mem.dram_share)) + launches * (
        kernels.LAUNCH_FLOOR_S + (mem.t0_s if not fused else 0.0))
    if not rt.graphs and shape.cache_copy_bytes:  # transformers' DynamicCache: torch.cat of each sequence's cache
        other_s += decode * shape.cache_copy_bytes * context / max(shape.context, 1) * layer_share / tp / (
            bw * mem.dram_share)
    gpu_s = gemm_s + attention_s + other_s
    # the runtime's host time: once a token step, shared by the stages a layer split takes turns over; a pipeline's
    # micro-batches are each a scheduler step of their own (``host_share`` 1)
    host_s = (rt.step_s + rt.seq_s * (decode + prefill_seqs)) * (layer_share if host_share is None else host_share)
    if not rt.graphs:  # eager: the host issues every op; the GPU runs behind it unless the host is slower
        eager = shape.other_dispatch_s * layer_share
        host_s += max(0.0, eager - gpu_s)
    comm_s = 0.0
    if tp > 1 and comm is not None and row:
        _, rate = comm
        blocks = g[:, 0] != shape.head[0] if len(g) else np.zeros(0, bool)
        outputs = float(g[blocks, 0] @ g[blocks, 2]) if len(g) else 0.0  # output elements of a token, all matrices
        matrices = float(g[blocks, 2].sum()) if len(g) else 0.0
        comm_s = layer_share * (matrices * rt.row_sync_s * (tp - 1) + m * outputs * 4 * (tp - 1) / tp / rate)
    elif tp > 1 and comm is not None:
        latency, rate = comm
        per = latency + 2 * m * shape.hidden * 2 * (tp - 1) / tp / rate
        comm_s = 2 * shape.layers * layer_share * per
    seconds = gpu_s + host_s + comm_s
    parts = {"host": host_s, "communication": comm_s, "compute" if compute_bound else "memory": gpu_s}
    return StepCost(seconds=seconds, gemm_s=gemm_s, attention_s=attention_s, other_s=other_s, host_s=host_s,
                    comm_s=comm_s, bound=max(parts, key=parts.get))
