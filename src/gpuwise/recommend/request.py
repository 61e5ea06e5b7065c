"""What recommend is asked: the goal, the serving traffic, the user's limits and filters, and the training run
(each a frozen dataclass that holds its defaults; the CLI passes only what the user gave).

>>> Constraints(mode="rent", max_gpus=8, segments=("datacenter",)).max_gpus
8
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import ECOSYSTEMS, SEGMENTS, VENDORS
from gpuwise.planning.cost.runtimes import FP4_BITS, GGUF_BITS, RUNTIMES, default_runtime
from gpuwise.planning.setup import KvDtype, Setup, Weights
from gpuwise.recommend.prices import Price

COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# the weight formats serving prices (llm_step.weight_itemsize): plan's, fp32, GGUF's types by name, and FP4
SERVED_WEIGHTS = ("fp32", *get_args(Weights), "f16", *GGUF_BITS, *FP4_BITS)
SPLITS = ("tp", "pp", "layer", "row")  # --split: how a replica spreads over its GPUs (cost/replica.py)
Mode = Literal["rent", "buy"]
# vLLM's defaults for vllm serve (docs.vllm.ai engine args, CacheConfig and SchedulerConfig, v0.9-0.10): 90% of each
# GPU's memory for weights, activations and the KV cache; at most 256 sequences in a batch
VLLM_GPU_MEMORY_UTILIZATION = 0.9
VLLM_MAX_NUM_SEQS = 256
SortKey = Literal["time", "cost", "energy"]


@dataclass(frozen=True, kw_only=True)
class Goal:
    """How much work: tokens (language models) or samples, to train or fine-tune on."""

    tokens: float | None = None
    samples: float | None = None

    def __post_init__(self) -> None:
        given = [(n, v) for n, v in (("tokens", self.tokens), ("samples", self.samples)) if v is not None]
        if len(given) > 1:
            raise GpuwiseError("--tokens and --samples both set the goal", "give one of them")
        for name, value in given:
            if not (math.isfinite(value) and value > 0):
                raise GpuwiseError(f"--{name} {value:g} is not a positive number", f"pass e.g. --{name} 1e9")

    @property
    def unit(self) -> str:
        return "samples" if self.samples is not None else "tokens"

    @property
    def amount(self) -> float | None:
        return self.samples if self.samples is not None else self.tokens


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """Serving: requests of ``prompt_tokens`` in and ``output_tokens`` out, ``concurrency`` users at once (or an
    aggregate ``tokens_per_s`` of output, or ``request_rate`` requests a second arriving at random), within optional
    latency targets, with weights stored as ``weights``, served by ``runtime`` (None: runtimes.default_runtime);
    and the engine's settings in vLLM's terms (``max_model_len``, ``max_num_seqs``, ``tensor_parallel``,
    ``gpu_memory_utilization``, ``kv_dtype``), the runtime's defaults where not given."""

    prompt_tokens: int = 512
    output_tokens: int = 256
    concurrency: int = 1
    tokens_per_s: float | None = None
    request_rate: float | None = None  # requests a second (Poisson arrivals) the fleet takes
    ttft_s: float | None = None  # time to first token
    tpot_s: float | None = None  # time per output token
    weights: str = "bf16"  # weight format: fp32, fp16, bf16, fp8, int8, int4, nf4, GGUF types, nvfp4, mxfp4
    kv_dtype: str | None = None  # the KV cache's storage (setup.KvDtype); None: the model's dtype, vLLM's auto
    max_model_len: int | None = None  # the context a replica holds a sequence at; None: prompt + output tokens
    max_num_seqs: int | None = None  # the most sequences a replica decodes at once; None: the runtime's default
    tensor_parallel: int | None = None  # GPUs a replica (vLLM's --tensor-parallel-size); None: each of 1, 2, 4, 8
    gpu_memory_utilization: float | None = None  # the share of each GPU's memory the engine may use; None: runtime's
    runtime: str | None = None  # llama.cpp, vllm, sglang, tensorrt-llm, hf; None: default_runtime(weights)
    split: str | None = None  # how a replica spreads over GPUs (SPLITS); None: every layout the runtime has

    def __post_init__(self) -> None:
        for name, value, limit in (("--prompt-tokens", self.prompt_tokens, 1 << 24),
                                   ("--output-tokens", self.output_tokens, 1 << 24),
                                   ("--concurrency", self.concurrency, 1 << 24)):
            if not 1 <= value <= limit:
                raise GpuwiseError(f"{name} {value} is outside 1..{limit}", f"pass e.g. {name} 256")
        for name, value, scale in (("--tokens-per-s", self.tokens_per_s, 1), ("--ttft-ms", self.ttft_s, 1e3),
                                   ("--tpot-ms", self.tpot_s, 1e3)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise GpuwiseError(f"{name} {value * scale:g} is not a positive number", f"pass e.g. {name} 50")
        if self.weights not in SERVED_WEIGHTS:
            raise GpuwiseError(f"--weights {self.weights!r} is not one of {', '.join(SERVED_WEIGHTS)}",
                               "pass --weights int4 (GPTQ/AWQ) or --weights bf16")
        if self.kv_dtype is not None and self.kv_dtype not in get_args(KvDtype):
            raise GpuwiseError(f"--kv-dtype {self.kv_dtype!r} is not one of {', '.join(get_args(KvDtype))}",
                               "pass --kv-dtype fp8 (half a 16-bit cache), or drop it for the model's dtype")
        for name, value in (("--max-num-seqs", self.max_num_seqs), ("--max-model-len", self.max_model_len),
                            ("--tensor-parallel-size", self.tensor_parallel)):
            if value is not None and not 1 <= value <= 1 << 24:
                raise GpuwiseError(f"{name} {value} is outside 1..{1 << 24}", f"pass e.g. {name} 8")
        if self.max_model_len is not None and self.max_model_len < self.prompt_tokens + self.output_tokens:
            raise GpuwiseError(f"--max-model-len {self.max_model_len} is shorter than --prompt-tokens "
                               f"{self.prompt_tokens} + --output-tokens {self.output_tokens}",
                               f"pass --max-model-len {self.prompt_tokens + self.output_tokens} or more, or fewer "
                               "tokens a request")
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float))
                              or not (math.isfinite(u) and 0 < u <= 1)):
            raise GpuwiseError(f"--gpu-memory-utilization {u} is outside (0, 1]",
                               f"pass a share of each GPU's memory, e.g. {VLLM_GPU_MEMORY_UTILIZATION} (vLLM's)")

        if self.runtime is not None and self.runtime not in RUNTIMES:
            raise GpuwiseError(f"--runtime {self.runtime!r} is not one gpuwise prices",
                               f"pass one of {', '.join(RUNTIMES)}")
        if self.split is not None and self.split not in SPLITS:
            raise GpuwiseError(f"--split {self.split!r} is not one of {', '.join(SPLITS)}",
                               "pass --split tp (tensor parallel) or --split layer (llama.cpp's default)")
        if self.request_rate is not None and not (math.isfinite(self.request_rate) and self.request_rate > 0):
            raise GpuwiseError(f"--request-rate {self.request_rate:g} is not a positive number",
                               "pass e.g. --request-rate 2 (requests a second)")
        if sum(x is not None for x in (self.tokens_per_s, self.request_rate)) > 1:
            raise GpuwiseError("--tokens-per-s and --request-rate both set the demand", "give one of them")

    @property
    def served_by(self) -> str:
        """The runtime the rows are priced for: the one named, else the default for the weights."""
        return self.runtime or default_runtime(self.weights)

    @property
    def memory_share(self) -> float:
        """--gpu-memory-utilization, else the runtime's own reservation."""
        return self.gpu_memory_utilization or RUNTIMES[self.served_by].memory_share

    @property
    def seqs_limit(self) -> int:
        """--max-num-seqs, else the runtime's default."""
        return self.max_num_seqs or RUNTIMES[self.served_by].max_seqs

    @property
    def context(self) -> int:
        """Tokens a sequence may hold in its KV cache: --max-model-len, else a request's at its end."""
        return self.max_model_len or self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """What the user rules out. Empty tuples mean "any"."""

    mode: Mode = "rent"
    budget_usd: float | None = None  # for the job when renting, for the GPUs when buying
    deadline_s: float | None = None
    max_gpus: int | None = None
    gpus: tuple[str, ...] = ()  # catalog keys
    segments: tuple[str, ...] = ()
    vendors: tuple[str, ...] = ()
    ecosystem: str | None = None  # "cuda": leave out stacks that need a port
    rent: Mapping[str, Price] = field(default_factory=dict)  # catalog key -> USD per GPU-hour (the user's quotes)
    buy: Mapping[str, Price] = field(default_factory=dict)  # catalog key -> USD per GPU
    rent_kind: str = "on-demand"  # or "spot": which of the price snapshot's offers a GPU rents at (prices.KINDS)
    provider: str | None = None  # the snapshot's cloud to rent from (None: the cheapest offer of any)

    def __post_init__(self) -> None:
        if self.mode not in ("rent", "buy"):
            raise GpuwiseError(f"unknown cost mode {self.mode!r}", "pass --rent or --buy")
        for name, value in (("--budget", self.budget_usd), ("--deadline", self.deadline_s)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise GpuwiseError(f"{name} {value:g} is not a positive number", f"pass e.g. {name} 1000")
        if self.max_gpus is not None and not 1 <= self.max_gpus <= COUNTS[-1]:
            raise GpuwiseError(f"--max-gpus {self.max_gpus} is outside 1..{COUNTS[-1]}", "pass e.g. --max-gpus 8")
        if bad := [s for s in self.segments if s not in SEGMENTS]:
            raise GpuwiseError(f"unknown --segment {bad[0]!r}", f"use one of {', '.join(SEGMENTS)}")
        if bad := [v for v in self.vendors if v.lower() not in {x.lower() for x in VENDORS}]:
            raise GpuwiseError(f"unknown --vendor {bad[0]!r}", f"use one of {', '.join(VENDORS)}")
        if self.ecosystem is not None and self.ecosystem not in ECOSYSTEMS:
            raise GpuwiseError(f"unknown --ecosystem {self.ecosystem!r}", f"use one of {', '.join(ECOSYSTEMS)}")
        from gpuwise.recommend.prices import check_offer_filter

        check_offer_filter(kind=self.rent_kind, provider=self.provider)


@dataclass(frozen=True, kw_only=True)
class Run:
    """The training run to rank, as the user gave it: the global batch, kept on every row (each GPU count splits
    it), and the Setup fields given (task, seq, precision, ...; what is not given keeps Setup's default)."""

    batch: int = 64
    options: Mapping[str, Any] = field(default_factory=dict)

    def setup(self) -> Setup:
        """The run on one GPU, the whole batch in one micro-batch: the search splits it per GPU count."""
        return Setup.for_batch(batch=self.batch, micro_batch=self.batch, **self.options)
