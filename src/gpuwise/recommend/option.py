"""The rows recommend ranks: one accelerator at one count, for training (the run that fits) or serving (replicas
of a tensor-parallel group), and the ranking they make together.

>>> r.rows[0].gpu, r.rows[0].time_to_goal_s                                           # doctest: +SKIP
('h100-sxm', 3600.0)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from gpuwise.hardware.catalog import Accelerator
from gpuwise.planning.setup import Setup
from gpuwise.recommend.prices import Costs
from gpuwise.recommend.request import Constraints, Goal, SortKey, Traffic

if TYPE_CHECKING:  # loads torch
    from gpuwise.planning.cost.kv_cache import SequenceKV
    from gpuwise.planning.experts import Experts


@dataclass(frozen=True, kw_only=True)
class Option(Costs):
    """What every row has: one accelerator at one count, how fast, and what it costs (``Costs``' fields). ``excluded``
    says why a row is not among the recommendations (then the figures may be missing)."""

    gpu: str  # catalog key
    name: str
    count: int
    fits: bool
    flags: str  # the flags to paste into gpuwise plan / gpuwise train for this row
    step_time_s: float | None  # training: an optimizer step; serving: a time per output token (or per batch)
    throughput: float | None  # tokens/s (or samples/s) over all the GPUs
    mfu: float | None
    time_to_goal_s: float | None
    basis: str
    excluded: str | None = None
    pareto: bool = False

    @classmethod
    def left_out(cls, acc: Accelerator, n: int, why: str) -> Option:
        """A row of this kind for ``n`` x ``acc`` that is not among the recommendations, and why."""
        return cls(gpu=acc.key, name=acc.name, count=n, fits=False, flags="", step_time_s=None, throughput=None,
                   mfu=None, time_to_goal_s=None, rent_usd_per_hour=None, rent_usd=None, buy_usd=None, buy_price=None,
                   energy_kwh=None, per_joule=None, basis="", excluded=why)

    @property
    def gpus_total(self) -> int:
        return self.count

    @property
    def per_gpu(self) -> float | None:
        return None if self.throughput is None else self.throughput / self.gpus_total

    def to_dict(self) -> dict[str, Any]:
        """Every figure by its name, training's and serving's both (None where this kind has none), in one order:
        the shape a guide's picks are written in. Shallow: a Setup or a Price stays one."""
        return {"gpu": self.gpu, "name": self.name, "count": self.count, "fits": self.fits,
                "setup": getattr(self, "setup", None), "flags": self.flags,
                "step_time_s": self.step_time_s, "throughput": self.throughput, "mfu": self.mfu,
                "time_to_goal_s": self.time_to_goal_s, "rent_usd_per_hour": self.rent_usd_per_hour,
                "rent_usd": self.rent_usd, "buy_usd": self.buy_usd, "buy_price": self.buy_price,
                "energy_kwh": self.energy_kwh, "per_joule": self.per_joule, "basis": self.basis,
                "excluded": self.excluded, "pareto": self.pareto,
                **{name: getattr(self, name, None) for name in ("phases_s", "families_s", "step_time_error")},
                **{name: getattr(self, name, None) for name in SERVING_FIELDS}}


@dataclass(frozen=True, kw_only=True)
class TrainingOption(Option):
    """A training row: the settings that fit (micro-batch, accumulation, precision, checkpointing, sharding)."""

    setup: Setup | None = None  # None: left out before a run was found
    # the step's time by phase (forward, backward, optimizer, communication, bubble) and by op family, and the model's
    # held-out relative error: cost/step.py's StepTime, the same numbers plan prints
    phases_s: dict[str, float] | None = None
    families_s: dict[str, float] | None = None
    step_time_error: float | None = None


@dataclass(frozen=True, kw_only=True)
class ServingOption(Option):
    """A serving row: one replica is ``count`` GPUs (tensor parallel); ``throughput`` is over every replica."""

    per_user: float | None = None  # output tokens/s each user sees (1 / time per output token)
    ttft_s: float | None = None
    max_concurrency: int | None = None  # sequences one replica's memory holds at the full context
    replicas: int | None = None
    decode_batch: int | None = None  # sequences a replica decodes in one step (a decoder)
    weight_bytes_read: float | None = None  # by one GPU in that step: all its weights, a MoE's experts touched
    # one sequence's KV cache at the full context on one GPU of the replica (kv_cache.SequenceKV.per_gpu)
    kv_bytes_per_seq: float | None = None
    # the vllm serve flags that run this row (a decoder): --max-model-len, --gpu-memory-utilization, --max-num-seqs,
    # --tensor-parallel-size, --kv-cache-dtype and the weights' --quantization (or --dtype)
    vllm_args: tuple[str, ...] | None = None
    runtime: str | None = None  # the runtime the row is priced for (cost/runtimes.py)
    # the replica's layout and the fleet: (("tp", n), ("pp", n), ("replicas", n))
    parallel: tuple[tuple[str, int], ...] | None = None
    runtime_command: str | None = None  # the runtime's own command for a row (llama-server, sglang, trtllm-serve)
    prefill_share: float | None = None  # of the tokens a replica processes, the prompts'

    @property
    def gpus_total(self) -> int:
        return self.count * (self.replicas or 1)


# what only a serving row has, in its order: the tail of every row in a guide's picks
SERVING_FIELDS = tuple(f.name for f in fields(ServingOption) if f.name not in {g.name for g in fields(Option)})


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    model: str
    setup: Setup  # as the user gave it (the global batch is kept on every row)
    goal: Goal
    constraints: Constraints
    unit: str  # "tokens" or "samples"
    sort: SortKey
    rows: tuple[Option, ...]  # ranked, fastest (or cheapest) first
    excluded: tuple[Option, ...]
    traffic: Traffic | None = None  # serving: what the replicas must sustain
    uneven_counts: tuple[int, ...] = ()  # GPU counts in range not tried: the global batch does not split over them
    # a Mixture of Experts: its routed experts (total and active parameters), and the routing its figures assume
    # (training: the captured step's, as plan reports it; serving: serving.UNIFORM_ROUTING)
    experts: Experts | None = None
    routing: str | None = None
    kv: SequenceKV | None = None  # serving a decoder: one sequence's KV cache at the full context, and its basis

    @property
    def best(self) -> Option | None:
        return self.rows[0] if self.rows else None
