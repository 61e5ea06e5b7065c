"""Serving: every catalog accelerator ranked for serving one model. A decoder by its decode model (time per output
token from the bytes each step reads, time to first token from the prompt's FLOPs, sequences per replica from the KV
cache that fits, replicas for the users); any other model by its captured inference step.

The KV cache is the model's own, as ``gpuwise plan --task decode`` captures it (planning/cost/kv_cache.py: sliding
windows, MLA's latent, hybrids' states), sized as vLLM sizes it (``--gpu-memory-utilization`` of each GPU's memory
less the weights and the prefill's activations); each row carries the ``vllm serve`` flags that run it.

A Mixture of Experts holds every expert; a decode step reads the experts its batch touches
(serving.moe_weights_read).

>>> r = serve(resolve_source("llama3-8b", None), Traffic(concurrency=32, weights="int4"))
>>> r.rows[0].gpu, r.rows[0].per_user                                                 # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gpuwise.errors import GpuwiseError, NotApplicable
from gpuwise.hardware.calibration import Calibration
from gpuwise.hardware.catalog import Accelerator, Catalog, load_catalog
from gpuwise.planning.setup import Setup
from gpuwise.precision import default_precision
from gpuwise.recommend.option import Option, Recommendation, ServingOption
from gpuwise.recommend.prices import costs
from gpuwise.recommend.rank import check_goal_for_limits, chosen, pareto, within
from gpuwise.recommend.request import COUNTS, Constraints, Goal, SortKey, Traffic
from gpuwise.recommend.search import time_step

if TYPE_CHECKING:  # the engine loads torch: imported where it runs, so the arguments are checked without it
    from gpuwise.planning.cost.kv_cache import SequenceKV
    from gpuwise.planning.experts import Experts
    from gpuwise.planning.parallel.sharding import PerGpu
    from gpuwise.planning.planner import Planner


def served_weights(source: Any, given: str | None) -> str | None:
    """``--weights`` for serving ``source``: a quantised checkpoint's own format when none is given (GPTQ/AWQ 4-bit:
    int4, bitsandbytes: nf4 or int8, fp8; sources/checkpoint.py), the given one otherwise; one that contradicts the
    checkpoint is refused, as plan refuses it (checkpoint.stored_weights)."""
    info = getattr(source, "checkpoint", None)
    if info is None or not info.quantized:
        return given
    own = info.weights
    if given is None:
        if own is None:
            raise GpuwiseError(f"{source.name} stores its weights as {info.describe()}, a format gpuwise does not lay "
                               "out", "pass --weights int4 (or int8, nf4, fp8) to rank it as the nearest one")
        return own
    if own is not None and given != own:
        raise GpuwiseError(f"--weights {given} contradicts {source.name}, whose weights are stored as "
                           f"{info.describe()} (--weights {own})", f"drop --weights, or pass --weights {own}")
    return given


def serve(source, traffic: Traffic, constraints: Constraints | None = None, *, batch: int = 1,
          precision: str | None = None, image_size: int | None = None, sort: SortKey = "cost", goal: Goal | None = None,
          catalog: Catalog | None = None, calibrations: Mapping[str, Calibration] | None = None) -> Recommendation:
    """Rank every accelerator for serving ``source``: a decoder by its decode model (time per output token from
    the bytes each step reads, time to first token from the prompt's FLOPs, sequences per replica from the KV
    cache that fits, replicas for the users); any other model by its captured inference step at ``batch``
    (int8 end to end with ``--weights int8``, and on chips that only have an int8 rate). ``goal`` in tokens (or
    samples) to produce prices the whole job."""
    from gpuwise.planning.planner import Planner

    c = constraints or Constraints()
    catalog = catalog or load_catalog()
    goal = goal or Goal()
    check_goal_for_limits(goal, c)
    calibrations = calibrations or {}
    dims = getattr(source, "decoder", None)
    rows: list[Option] = []
    excluded: list[Option] = []
    planner = Planner(source)
    experts = getattr(source, "experts", None) if dims is not None else None
    if dims is not None:
        if goal.samples is not None:
            raise GpuwiseError("a language model's serving goal is in tokens", "pass --tokens")
        if batch != 1 or precision is not None or image_size is not None:
            flag = "--batch" if batch != 1 else "--precision" if precision is not None else "--image-size"
            raise GpuwiseError(f"{flag} does not apply to serving a language model",
                               f"drop {flag}: --concurrency sets the batch, --weights the storage")
        limit = source.max_positions
        if limit is not None and traffic.context > limit:
            given = "--max-model-len" if traffic.max_model_len is not None else "--prompt-tokens + --output-tokens"
            raise GpuwiseError(f"{given} = {traffic.context} is more than {source.name}'s {limit} positions",
                               f"keep {'it' if traffic.max_model_len is not None else 'the two'} under {limit + 1}")
        # the formats plan simulates are captured as stored (quantize.py: embeddings and head stay 16-bit)
        from gpuwise.planning.cost.kv_cache import sequence_kv
        from gpuwise.planning.transforms.quantize import FORMATS

        setup = Setup(task="infer", micro_batch=1, seq=traffic.prompt_tokens, precision="bf16",
                      weights=traffic.weights if traffic.weights in FORMATS else None)
        try:
            step = planner.per_gpu(setup)
        except NotApplicable as exc:
            raise GpuwiseError(*exc.args) from exc
        # the model's own cache (plan --task decode's capture): at the full context for the sequences that fit, at
        # the mean one for the bytes a step reads
        kv = sequence_kv(planner, dims, context=traffic.context, kv_dtype=traffic.kv_dtype)
        mean = traffic.prompt_tokens + traffic.output_tokens // 2
        kv_read = kv if mean == traffic.context else sequence_kv(planner, dims, context=mean,
                                                                 kv_dtype=traffic.kv_dtype)
        for acc in catalog:
            if chosen(acc, c):
                found, why = _serve_decoder(acc, dims, step, traffic, c, goal, calibrations.get(acc.key),
                                            experts=experts, kv=kv, kv_read=kv_read)
                rows.extend(found)
                if not found:
                    excluded.append(ServingOption.left_out(acc, 1, why))
        unit = "tokens"
    else:
        if goal.tokens is not None:
            raise GpuwiseError(f"{source.name} does not generate tokens", "give the serving goal as --samples")
        for flag, v in (("--kv-dtype", traffic.kv_dtype), ("--max-model-len", traffic.max_model_len),
                        ("--tensor-parallel-size", traffic.tensor_parallel)):
            if v is not None:
                raise GpuwiseError(f"{flag} applies to serving a language model (vLLM's engine), not {source.name}",
                                   f"drop {flag}")
        if traffic.weights not in ("bf16", "fp16", "int8"):
            raise GpuwiseError(f"--weights {traffic.weights} applies to language models",
                               "pass --weights int8 (or bf16) for this model")
        for acc in catalog:
            if chosen(acc, c):
                option, why = _serve_step(acc, planner, Setup(task="infer", micro_batch=batch, image_size=image_size,
                                                              precision=precision or _infer_precision(acc)),
                                          traffic, c, goal, calibrations.get(acc.key))
                if option is None:
                    excluded.append(ServingOption.left_out(acc, 1, why))
                else:
                    rows.append(option)
        unit = "samples"
    kept, out = within(rows, c)
    cost = serving_cost(c)
    front = pareto([replace(r, time_to_goal_s=r.step_time_s) for r in kept], cost)
    kept = [replace(r, pareto=i in front) for i, r in enumerate(kept)]
    key = {"time": lambda r: (r.step_time_s, cost(r)), "cost": lambda r: (cost(r), r.step_time_s),
           "energy": lambda r: (-(r.per_joule or 0.0), cost(r))}[sort]
    kept.sort(key=key)
    routing = None
    if experts is not None:
        from gpuwise.planning.cost.serving import UNIFORM_ROUTING as routing
    return Recommendation(model=source.name, setup=Setup(task="infer", micro_batch=batch), goal=goal,
                          constraints=c, unit=unit, sort=sort, rows=tuple(kept), excluded=tuple(excluded + out),
                          traffic=traffic, experts=experts, routing=routing, kv=kv if dims is not None else None)


def serving_cost(c: Constraints) -> Callable[[Option], float]:
    """Rent of the whole fleet per hour, or the purchase of every GPU in it."""
    def cost(r: Option) -> float:
        if c.mode == "rent":
            return r.rent_usd_per_hour.usd * r.gpus_total if r.rent_usd_per_hour is not None else math.inf
        return r.buy_usd if r.buy_usd is not None else math.inf
    return cost


# Tensor parallelism past 8 GPUs pays per-layer all-reduce latencies the decode model leaves out; serving stacks
# stop at a node of 8 (vLLM and TensorRT-LLM publish TP <= 8), and so does the search.
MAX_TENSOR_PARALLEL = 8


def _powers_within(acc: Accelerator, c: Constraints, traffic: Traffic) -> list[int]:
    """The replica sizes to try: 1, 2, 4, 8 GPUs of a node, or the --tensor-parallel-size given (up to a node)."""
    if traffic.tensor_parallel is not None:
        return [traffic.tensor_parallel] if traffic.tensor_parallel <= min(acc.node_gpus, c.max_gpus or COUNTS[-1]) \
            else []
    top = min(acc.node_gpus, MAX_TENSOR_PARALLEL, c.max_gpus or COUNTS[-1])
    return [n for n in COUNTS if n <= top]


# vllm serve's flag for each --weights that is not the bf16 it computes in: the quantised checkpoints vLLM runs
# (docs.vllm.ai, engine args --quantization: awq, bitsandbytes, fp8, gguf; --dtype float16, float32)
VLLM_WEIGHTS = {"int4": ("--quantization", "awq"), "int8": ("--quantization", "bitsandbytes"),
                "nf4": ("--quantization", "bitsandbytes"), "fp8": ("--quantization", "fp8"),
                "q4_k_m": ("--quantization", "gguf"), "fp16": ("--dtype", "float16"),
                "fp32": ("--dtype", "float32")}


def vllm_args(*, max_model_len: int, memory_share: float, max_num_seqs: int, tensor_parallel: int,
              kv_cache_dtype: str, weights: str) -> tuple[str, ...]:
    """The ``vllm serve`` flags of one serving row.

    >>> " ".join(vllm_args(max_model_len=4096, memory_share=0.42, max_num_seqs=32, tensor_parallel=1,
    ...                    kv_cache_dtype="fp8", weights="int4")[2:])
    '--gpu-memory-utilization 0.42 --max-num-seqs 32 --tensor-parallel-size 1 --kv-cache-dtype fp8 --quantization awq'
    """
    return ("--max-model-len", str(max_model_len), "--gpu-memory-utilization", f"{memory_share:.2f}",
            "--max-num-seqs", str(max_num_seqs), "--tensor-parallel-size", str(tensor_parallel),
            "--kv-cache-dtype", kv_cache_dtype, *VLLM_WEIGHTS.get(weights, ()))


def memory_share(used_bytes: float, acc: Accelerator, budget: float) -> float:
    """vLLM's --gpu-memory-utilization for a replica that uses ``used_bytes`` of each GPU (weights, the profiled
    activations, and the KV cache of its sequences at the full context): that share of the GPU's whole memory,
    rounded up to the hundredth, never above the ``budget`` the sizing allowed."""
    return min(math.ceil(used_bytes / acc.memory_bytes * 100 - 1e-9) / 100, budget)


def _serve_decoder(acc: Accelerator, dims, step: PerGpu, traffic: Traffic, c: Constraints, goal: Goal,
                   calibration: Calibration | None, *, kv: SequenceKV, kv_read: SequenceKV,
                   experts: Experts | None = None) -> tuple[list[Option], str]:
    """One row per replica size (1, 2, 4, ... GPUs of a node, tensor parallel) that holds the weights and at
    least one sequence at the full context, within the latency targets. ``kv``: one sequence's cache at the full
    context (what sizes the sequences that fit), ``kv_read`` at the mean one (what a step reads), both the model's
    own (kv_cache.sequence_kv); a replica decodes at most ``traffic.max_num_seqs`` sequences at once, as vLLM.

    A Mixture of Experts (``experts``) holds every expert, but a step reads the dense weights and the experts its
    batch touches (serving.moe_weights_read, uniform routing); tensor parallelism splits every expert's matrices
    over the replica's GPUs, so each GPU reads that share of its slice."""
    from gpuwise.planning.capture.tracker import CATEGORIES
    from gpuwise.planning.cost.comm import collective_seconds
    from gpuwise.planning.cost.serving import bytes_per_weight, decode_time, max_concurrency

    params = step.workload.params
    weights = params * bytes_per_weight(traffic.weights)
    if step.setup.quantized:  # as captured: the quantised layers and the 16-bit rest, the figure plan shows
        weights = float(step.live[:, CATEGORIES.index("weights")].max())
    live = step.live[int(step.live.sum(axis=1).argmax())]
    activations = float(live.sum() - live[CATEGORIES.index("weights")] - live[CATEGORIES.index("kv_cache")])
    mean_context = traffic.prompt_tokens + traffic.output_tokens // 2

    def moe(n: int) -> dict:
        """decode_time's MoE arguments for one of ``n`` GPUs: its share of the active parameters (the captured
        step's parameters are the total, experts.Experts')."""
        if experts is None:
            return {}
        return {"active_params": params / n * experts.active / experts.total, "experts": experts.experts,
                "top_k": experts.top_k}

    if not any(acc.peak_tflops.get(k) for k in ("bf16", "fp16", "fp32")):
        return [], "no 16- or 32-bit rate: runs exported int8 graphs only, not a language model's decode"
    tp = traffic.tensor_parallel
    rows, why = [], ("the weights and one sequence's KV cache do not fit even on a full node" if tp is None else
                     f"the weights and one sequence's KV cache do not fit on {tp} GPUs")
    if tp is not None and not _powers_within(acc, c, traffic):
        why = f"--tensor-parallel-size {tp} is more than the {min(acc.node_gpus, c.max_gpus or tp)} GPUs allowed"
    latent = getattr(dims, "kv_latent", 0)  # MLA's latent cache is whole on every GPU (sources.base.Decoder)
    for n in _powers_within(acc, c, traffic):
        if dims.heads % n:
            why = f"{dims.heads} attention heads do not split over {n} GPUs"
            continue
        kv_heads = math.ceil(dims.kv_heads / n)  # tensor parallel splits the KV heads (replicated below one a GPU)
        kv_seq = kv.per_gpu(n)
        fits = max_concurrency(acc, weight_bytes=weights / n, kv_bytes_per_sequence=kv_seq,
                               activation_bytes=activations, utilization=traffic.gpu_memory_utilization)
        if fits == 0:
            continue
        comm_per_seq, link_note = 0.0, ""
        if n > 1:
            # the link's bus bandwidth for large messages (cost/comm.py: measured tables, else the link's fit)
            link = collective_seconds("all-reduce", 2.0**28, n, acc, dtype="bf16")
            if link is None:
                why = f"no known link between {n} of these"
                continue
            # two all-reduces of each token's hidden state per layer (Megatron tensor parallel), 16-bit
            hidden = dims.heads * dims.head_dim
            comm_per_seq = 2 * dims.layers * hidden * 2 * 2 * (n - 1) / n / (link.busbw_gbps * 1e9)
            link_note = f" · tensor parallel over {n}: 2 all-reduces a layer at {link.source} (latency not modelled)"

        def at(batch: int, n: int = n, kv_heads: int = kv_heads, comm_per_seq: float = comm_per_seq):
            d = decode_time(acc, params=params / n, layers=dims.layers, kv_heads=kv_heads, head_dim=dims.head_dim,
                            heads=max(1, dims.heads // n), weight_bytes=weights / n, batch=batch,
                            context=mean_context, prompt_tokens=traffic.prompt_tokens, calibration=calibration,
                            kv_latent=latent, kv_bytes_per_seq=kv_read.per_gpu(n), **moe(n))
            return None if d is None else (d, d.seconds_per_token + comm_per_seq * batch)

        most = min(fits, traffic.max_num_seqs)  # vLLM's --max-num-seqs
        batch = min(most, traffic.concurrency) if traffic.tokens_per_s is None else most
        got = at(batch)
        if got is None:
            return [], "no memory bandwidth in the catalog"
        while traffic.tpot_s is not None and got[1] > traffic.tpot_s and batch > 1:
            batch = max(1, batch // 2)
            got = at(batch)
        d, tpot = got
        if traffic.tpot_s is not None and tpot > traffic.tpot_s:
            why = f"{tpot * 1e3:.3g} ms per output token, over --tpot-ms {traffic.tpot_s * 1e3:g}"
            continue
        if traffic.ttft_s is not None and d.ttft_s > traffic.ttft_s:
            why = f"{d.ttft_s * 1e3:.3g} ms to the first token, over --ttft-ms {traffic.ttft_s * 1e3:g}"
            continue
        per_replica = batch / tpot
        replicas = (math.ceil(traffic.tokens_per_s / per_replica) if traffic.tokens_per_s is not None
                    else math.ceil(traffic.concurrency / batch))
        if c.max_gpus is not None and replicas * n > c.max_gpus:
            why = f"needs {replicas * n} GPUs ({replicas} replicas of {n}), over --max-gpus {c.max_gpus}"
            continue
        share = memory_share(weights / n + activations + batch * kv_seq, acc, traffic.gpu_memory_utilization)
        args = vllm_args(max_model_len=traffic.context, memory_share=share, max_num_seqs=batch, tensor_parallel=n,
                         kv_cache_dtype=kv.kv_dtype, weights=traffic.weights)
        rows.append(_served(acc, n, replicas, per_replica * replicas, tpot, d.ttft_s, fits, goal, c,
                            d.basis + link_note, flags=f"--weights {traffic.weights}" if traffic.weights != "bf16"
                            else "", decode_batch=batch, weight_bytes_read=d.weight_bytes_read,
                            kv_bytes_per_seq=kv_seq, vllm_args=args))
    return rows, why


def _infer_precision(acc: Accelerator) -> str:
    """Inference holds its weights in the compute dtype: pure bf16 where the chip has it, else fp16."""
    return "bf16" if acc.bf16 else default_precision(gpu=True, bf16=False)


def _serve_step(acc: Accelerator, planner: Planner, setup: Setup, traffic: Traffic, c: Constraints, goal: Goal,
                calibration: Calibration | None) -> tuple[Option | None, str]:
    """A non-decoder model served one batch at a time on one GPU per replica: the captured inference step."""
    int8 = traffic.weights == "int8"
    sixteen = acc.peak_tflops.get("bf16") or acc.peak_tflops.get("fp16")
    if not int8 and not sixteen:
        if not acc.peak_tflops.get("int8"):
            return None, "no bf16, fp16 or int8 rate in the catalog"
        int8 = True  # an int8-only chip (Coral, NPUs) runs the model quantised
    if int8 and not acc.peak_tflops.get("int8"):
        return None, "no int8 rate in the catalog"
    batch = setup.micro_batch
    try:
        step = planner.per_gpu(setup)
    except NotApplicable as exc:
        return None, exc.args[0]
    need = step.peak_bytes / (step.setup.compute_dtype.itemsize if int8 else 1)
    if need > acc.memory_bytes:
        return None, f"needs {need / 2**30:.3g} GiB, has {acc.memory_bytes / 2**30:.3g}"
    t = time_step(step, acc, calibration, int8=int8)
    if t is None:
        return None, "no rate or memory bandwidth in the catalog"
    per_replica = batch / t.seconds
    replicas = math.ceil(traffic.tokens_per_s / per_replica) if traffic.tokens_per_s is not None else 1
    if c.max_gpus is not None and replicas > c.max_gpus:
        return None, f"needs {replicas} GPUs, over --max-gpus {c.max_gpus}"
    return _served(acc, 1, replicas, per_replica * replicas, t.seconds, t.seconds, None, goal, c, t.basis,
                   flags="--weights int8" if int8 else "", mfu=t.mfu), ""


def _served(acc: Accelerator, n: int, replicas: int, throughput: float, latency: float, first: float,
            fits: int | None, goal: Goal, c: Constraints, basis: str, *, flags: str, mfu: float | None = None,
            decode_batch: int | None = None, weight_bytes_read: float | None = None,
            kv_bytes_per_seq: float | None = None, vllm_args: tuple[str, ...] | None = None) -> ServingOption:
    gpus = n * replicas
    hours = None if goal.amount is None else goal.amount / throughput / 3600
    return ServingOption(
        gpu=acc.key, name=acc.name, count=n, fits=True, flags=flags, step_time_s=latency, throughput=throughput,
        mfu=mfu, time_to_goal_s=None if hours is None else hours * 3600, basis=basis, per_user=1 / latency,
        ttft_s=first, max_concurrency=fits, replicas=replicas, decode_batch=decode_batch,
        weight_bytes_read=weight_bytes_read, kv_bytes_per_seq=kv_bytes_per_seq, vllm_args=vllm_args,
        **costs(acc, gpus=gpus, throughput=throughput, hours=hours, rent=c.rent, buy=c.buy, kind=c.rent_kind,
              provider=c.provider).figures())

