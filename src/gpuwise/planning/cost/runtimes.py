"""The serving runtimes gpuwise prices, each as it really serves: how it batches, what a step costs it besides the
GPU's kernels, how it spreads a model over GPUs, and which weight and KV formats it runs. The one place that decides
them (``runtime``); ``--runtime`` names one, ``default_runtime`` picks one where none is named, and every serving
row says which.

Facts (defaults as of each runtime's 2025 releases; sources beside each field):

- vLLM (V1 engine): continuous batching with chunked prefill: each scheduler step takes the running sequences' one
  decode token each, then prompt chunks, up to ``max_num_batched_tokens`` (``vllm serve``: 2048, 8192 on GPUs of
  70 GiB or more; vllm/engine/arg_utils.py ``get_batch_defaults``); at most ``max_num_seqs`` sequences (256,
  1024 on the big GPUs); the KV cache in blocks of 16 tokens; ``gpu_memory_utilization`` 0.9 of each GPU's memory
  for weights, activations and the cache; decode steps replay CUDA graphs; tensor parallel with its custom
  all-reduce (one-shot over NVLink/xGMI peers, else NCCL), pipeline parallel.
- SGLang: the same policy (``chunked_prefill_size`` 8192, 2048 on small GPUs; ``mem_fraction_static`` ~0.88;
  token-level KV (page size 1); CUDA graphs up to ``cuda_graph_max_bs``); tensor and pipeline parallel.
- TensorRT-LLM: in-flight batching with ``max_num_tokens`` 8192 and ``max_batch_size`` 2048 (trtllm-bench picks its
  own per engine), paged KV blocks of 32 tokens, ``free_gpu_memory_fraction`` 0.9 of what the weights leave;
  fused kernels, FP8 on Ada/Hopper and FP4 on Blackwell.
- llama.cpp (llama-server / llama-bench): a few slots decoded together (``--parallel``; llama-bench: one
  sequence), prompts in ``--ubatch-size`` 512 chunks; the whole context allocated up front; across GPUs the default
  ``--split-mode layer`` gives each GPU a run of layers and they take turns (one GPU busy at a time), ``row``
  splits each matrix (tensor parallel without NCCL). GGUF weights (q4_0 ... q8_0, f16, bf16) and KV (f16, q8_0).
- transformers ``generate`` (hf): static batching (a batch is prefilled together, decoded until its longest
  sequence ends, then the next), every op dispatched eagerly from Python; ``device_map="auto"`` splits layers over
  GPUs (sequential, as llama.cpp's layer split).

Fitted constants (``step_s``, ``stream``) come from published runs listed in ``FIT_RUNS`` (benchmarks/
serving_truth.py scores every other run as held out).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from gpuwise.errors import GpuwiseError

Batching = Literal["continuous", "slots", "static"]

# Bits per weight of GGUF's and FP4's formats, as stored (llm_step.WEIGHT_BYTES, the one table, reads them).
# GGUF block layouts (ggml/src/ggml-common.h): q4_0 a 2-byte scale + 16 B for 32 weights = 4.5 bits; q8_0 2 + 32 B
# for 32 = 8.5; q4_K 144 B for 256 = 4.5, q5_K 176 B = 5.5, q6_K 210 B = 6.5625. The _M mixes store some tensors
# (half of attn_v and ffn_down, the output) one type up: llama.cpp's own table (tools/quantize/README.md,
# Llama-3.1-8B) gives 4.8944 bits a weight for Q4_K_M and 5.7036 for Q5_K_M.
# nvfp4: 4-bit e2m1 with an fp8 scale per 16 (4.5 bits; NVIDIA, "Introducing NVFP4", 2025); mxfp4: e2m1 with an
# e8m0 scale per 32 (4.25 bits; OCP Microscaling spec v1.0).
GGUF_BITS = MappingProxyType({"q4_0": 4.5, "q4_k_m": 4.89, "q5_k_m": 5.70, "q6_k": 6.5625, "q8_0": 8.5})
FP4_BITS = MappingProxyType({"nvfp4": 4.5, "mxfp4": 4.25})
FP4_ARCHS = ("Blackwell",)  # FP4 tensor cores: B200, GB200, RTX 50, RTX PRO 6000 Blackwell


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """How one serving runtime serves (module docstring for the sources)."""

    name: str
    batching: Batching  # continuous (chunked prefill in each step), slots (a few sequences), static (hf generate)
    max_seqs: int  # sequences decoded at once by default (vLLM --max-num-seqs; llama.cpp --parallel)
    step_tokens: int  # tokens a step may take (prompt chunks + decode): max_num_batched_tokens / ubatch
    kv_block: int  # tokens a KV block holds (a sequence's cache is whole blocks)
    memory_share: float  # of each GPU's memory the runtime may fill (weights, activations, KV)
    graphs: bool  # decode steps replay CUDA graphs: a kernel costs its GPU time, no host dispatch
    kernels_per_layer: int  # kernels a decoder layer launches in a decode step (fused runtimes; hf: captured)
    step_s: float  # host time of a step the GPU waits for (scheduling, sampling, detokenising): fitted
    seq_s: float  # host time each sequence of a step adds (sampling, output processing)
    request_s: float  # a request's own host time before its first token (API server, tokenising): fitted
    stream: float  # weight-streaming GEMV kernels' share of the bandwidth NeuSight's streaming kernels reach
    quant_stream: float  # the same for quantised weights (dequantising kernels: Marlin, mmvq)
    quant_compute: float  # their share of the tensor rate where a step is compute-bound (prompts): fitted
    fast_allreduce_s: float | None  # a small all-reduce between peer-linked GPUs (custom all-reduce); None: NCCL
    row_sync_s: float = 0.0  # llama.cpp --split-mode row: each split matrix's gather and sync per extra GPU: fitted
    # ggml-cuda's mmq kernels multiply quantised blocks with int8 MMA (the activations quantised to q8_1): its
    # quantised GEMMs run at the int8 tensor rate, not the 16-bit one
    int8_mma: bool = False
    hbm_stream: float = 1.0  # its streaming kernels' share on HBM boards of what they reach on GDDR: fitted
    compute: float = 1.0  # 16-bit GEMMs' share of the tile model's rate where a step is compute-bound: fitted
    legacy_mma: bool = False  # its kernels use Ampere's mma.sync, not Hopper's warp-group MMA (llama.cpp)
    splits: tuple[str, ...]  # how it spreads one replica over GPUs: "tp", "pp" (vLLM, SGLang, TRT), "layer" (llama.cpp)
    weights: tuple[str, ...]  # --weights it runs
    kv_dtypes: tuple[str, ...]  # --kv-dtype it stores
    basis: str  # where the constants come from

    def runs(self, weights: str) -> bool:
        return weights in self.weights


_GGUF = tuple(GGUF_BITS)
_HF_W = ("bf16", "fp16", "fp32", "int8", "nf4", "int4")
_FITTED = "fitted on benchmarks/serving_truth.py's FIT rows (the rest held out: benchmarks/RESULTS.md)"
RUNTIMES: MappingProxyType[str, Runtime] = MappingProxyType({
    "vllm": Runtime(
        name="vllm", batching="continuous", max_seqs=256, step_tokens=8192, kv_block=16, memory_share=0.9,
        graphs=True, kernels_per_layer=9, step_s=3.2e-3, seq_s=80e-6, request_s=75e-3, stream=1.0,
        quant_stream=0.85, quant_compute=0.8, fast_allreduce_s=8e-6, splits=("tp", "pp"),
        weights=("bf16", "fp16", "fp32", "fp8", "int8", "int4", "nf4", "nvfp4", "mxfp4", *_GGUF),
        kv_dtypes=("auto", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2"), basis=_FITTED),
    "sglang": Runtime(
        name="sglang", batching="continuous", max_seqs=1024, step_tokens=8192, kv_block=1, memory_share=0.88,
        graphs=True, kernels_per_layer=9, step_s=2.2e-3, seq_s=80e-6, request_s=10e-3, stream=1.0,
        quant_stream=0.85, quant_compute=0.8, fast_allreduce_s=8e-6, splits=("tp", "pp"),
        weights=("bf16", "fp16", "fp8", "int8", "int4", "nvfp4", "mxfp4"),
        kv_dtypes=("auto", "bf16", "fp16", "fp8", "fp8_e4m3", "fp8_e5m2"), basis=_FITTED),
    "tensorrt-llm": Runtime(
        name="tensorrt-llm", batching="continuous", max_seqs=2048, step_tokens=8192, kv_block=32,
        memory_share=0.95, graphs=True, kernels_per_layer=7, step_s=1.6e-3, seq_s=2e-6, request_s=10e-3,
        stream=1.0, quant_stream=0.9, quant_compute=0.9, fast_allreduce_s=6e-6, splits=("tp", "pp"),
        weights=("bf16", "fp16", "fp8", "int8", "int4", "nvfp4"),
        kv_dtypes=("auto", "bf16", "fp16", "fp8", "fp8_e4m3"), basis=_FITTED),
    "llama.cpp": Runtime(
        name="llama.cpp", batching="slots", max_seqs=1, step_tokens=512, kv_block=256, memory_share=1.0,
        graphs=True, kernels_per_layer=14, step_s=3.2e-3, seq_s=50e-6, request_s=1e-3, stream=1.0,
        quant_stream=1.22, quant_compute=0.2, fast_allreduce_s=None, row_sync_s=50e-6, int8_mma=True, compute=0.9,
        hbm_stream=0.65, legacy_mma=True, splits=("layer", "row"),
        weights=("f16", "bf16", "fp16", "fp32", "mxfp4", *_GGUF),
        kv_dtypes=("auto", "bf16", "fp16"), basis=_FITTED),
    "hf": Runtime(
        name="hf", batching="static", max_seqs=256, step_tokens=1 << 30, kv_block=1, memory_share=1.0,
        graphs=False, kernels_per_layer=0, step_s=0.5e-3, seq_s=20e-6, request_s=1e-3, stream=1.0,
        quant_stream=0.5, quant_compute=0.5, fast_allreduce_s=None, splits=("layer",),
        weights=_HF_W, kv_dtypes=("auto", "bf16", "fp16"),
        basis="eager dispatch measured (NeuSight's per-op latencies); host step and formats assumed (no published "
              "run to fit on)"),
})


def runtime(name: str) -> Runtime:
    """The runtime called ``name`` (``--runtime``)."""
    if name not in RUNTIMES:
        raise GpuwiseError(f"--runtime {name!r} is not one gpuwise prices", f"pass one of {', '.join(RUNTIMES)}")
    return RUNTIMES[name]


def default_runtime(weights: str) -> str:
    """The runtime a row is priced for when none is named: llama.cpp for GGUF weights (the runtime they are made
    for), else vLLM (the most used engine; ``recommend --serve`` prints its command)."""
    return "llama.cpp" if weights in GGUF_BITS or weights == "f16" else "vllm"


def check_formats(rt: Runtime, weights: str, kv_dtype: str | None) -> None:
    """Refuse a weight or KV format the runtime does not run, naming the ones it does."""
    if not rt.runs(weights):
        other = next((r.name for r in RUNTIMES.values() if r.runs(weights)), None)
        hint = f"pass --weights {' or '.join(rt.weights[:4])}" + (f", or --runtime {other}" if other else "")
        raise GpuwiseError(f"{rt.name} does not run --weights {weights}", hint)
    if kv_dtype is not None and kv_dtype not in rt.kv_dtypes:
        raise GpuwiseError(f"{rt.name} does not store a {kv_dtype} KV cache",
                           f"pass --kv-dtype {' or '.join(k for k in rt.kv_dtypes if k != 'auto')}, or drop it")
