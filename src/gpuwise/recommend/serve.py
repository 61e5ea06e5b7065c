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
        shape = decoder_shape(planner, dims, step, traffic, kv_read)
        for acc in catalog:
            if chosen(acc, c):
                found, why = _serve_decoder(acc, dims, step, traffic, c, goal, calibrations.get(acc.key),
                                            experts=experts, kv=kv, kv_read=kv_read, shape=shape, model=source.name)
                rows.extend(found)
                if not found:
                    excluded.append(ServingOption.left_out(acc, 1, why))
        unit = "tokens"
    else:
        if goal.tokens is not None:
            raise GpuwiseError(f"{source.name} does not generate tokens", "give the serving goal as --samples")
        for flag, v in (("--kv-dtype", traffic.kv_dtype), ("--max-model-len", traffic.max_model_len),
                        ("--tensor-parallel-size", traffic.tensor_parallel), ("--runtime", traffic.runtime),
                        ("--split", traffic.split), ("--request-rate", traffic.request_rate)):
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
                "q4_k_m": ("--quantization", "gguf"), "q4_0": ("--quantization", "gguf"),
                "q5_k_m": ("--quantization", "gguf"), "q6_k": ("--quantization", "gguf"),
                "q8_0": ("--quantization", "gguf"), "nvfp4": ("--quantization", "modelopt_fp4"),
                "mxfp4": ("--quantization", "mxfp4"), "fp16": ("--dtype", "float16"),
                "fp32": ("--dtype", "float32")}


def vllm_args(*, max_model_len: int, memory_share: float, max_num_seqs: int, tensor_parallel: int,
              kv_cache_dtype: str, weights: str, pipeline_parallel: int = 1) -> tuple[str, ...]:
    """The ``vllm serve`` flags of one serving row.

    >>> " ".join(vllm_args(max_model_len=4096, memory_share=0.42, max_num_seqs=32, tensor_parallel=1,
    ...                    kv_cache_dtype="fp8", weights="int4")[2:])
    '--gpu-memory-utilization 0.42 --max-num-seqs 32 --tensor-parallel-size 1 --kv-cache-dtype fp8 --quantization awq'
    """
    return ("--max-model-len", str(max_model_len), "--gpu-memory-utilization", f"{memory_share:.2f}",
            "--max-num-seqs", str(max_num_seqs), "--tensor-parallel-size", str(tensor_parallel),
            *(("--pipeline-parallel-size", str(pipeline_parallel)) if pipeline_parallel > 1 else ()),
            "--kv-cache-dtype", kv_cache_dtype, *VLLM_WEIGHTS.get(weights, ()))


def memory_share(used_bytes: float, acc: Accelerator, budget: float) -> float:
    """vLLM's --gpu-memory-utilization for a replica that uses ``used_bytes`` of each GPU (weights, the profiled
    activations, and the KV cache of its sequences at the full context): that share of the GPU's whole memory,
    rounded up to the hundredth, never above the ``budget`` the sizing allowed."""
    return min(math.ceil(used_bytes / acc.memory_bytes * 100 - 1e-9) / 100, budget)


def decoder_shape(planner: Planner, dims, step: PerGpu, traffic: Traffic, kv_read: SequenceKV):
    """The model's kernels for the serving step model (llm_step.LlmShape): its captured decode step at the mean
    context (one sequence, whose cache is ``kv_read``), else its captured inference step of the prompt."""
    from gpuwise.planning.cost.replica import model_shape

    mean = traffic.prompt_tokens + traffic.output_tokens // 2
    return model_shape(planner, dims, context=mean, kv_dtype=traffic.kv_dtype, fallback=step, kv=kv_read)[0]


def runtime_command(rt_name: str, model: str, *, tp: int, pp: int, split: str, seqs: int, context: int,
                    weights: str, kv_dtype: str) -> str:
    """The command line that runs one row on its runtime (vLLM's is vllm_args', with its memory share)."""
    if rt_name == "llama.cpp":
        quant = weights.upper() if weights not in ("bf16", "fp16", "f16", "fp32") else "F16"
        mode = "none" if tp * pp == 1 else split if split in ("layer", "row") else "layer"
        return (f"llama-server -m {model}-{quant}.gguf -ngl 99 -c {context * seqs} --parallel {seqs} "
                f"--split-mode {mode}")
    if rt_name == "sglang":
        return (f"python -m sglang.launch_server --model-path {model} --tp {tp} --pp-size {pp} "
                f"--context-length {context} --max-running-requests {seqs}"
                + (f" --kv-cache-dtype {kv_dtype}" if kv_dtype != "auto" else ""))
    if rt_name == "tensorrt-llm":
        return (f"trtllm-serve {model} --tp_size {tp} --pp_size {pp} --max_batch_size {seqs} "
                f"--max_seq_len {context}")
    if rt_name == "hf":
        return (f"AutoModelForCausalLM.from_pretrained({model!r}, device_map='auto').generate(batch of {seqs}, "
                f"max_new_tokens=...)")
    return ""


def _serve_decoder(acc: Accelerator, dims, step: PerGpu, traffic: Traffic, c: Constraints, goal: Goal,
                   calibration: Calibration | None, *, kv: SequenceKV, kv_read: SequenceKV, shape,
                   experts: Experts | None = None, model: str = "") -> tuple[list[Option], str]:
    """One row per replica size (1, 2, 4, ... GPUs of a node) that holds the weights and at least one sequence at
    the full context, within the latency targets, in the runtime's best layout for it (cost/replica.py: tensor
    parallel, pipeline, llama.cpp's layer or row split); the traffic spread over replicas. ``kv``: one sequence's
    cache at the full context (what sizes the sequences that fit), ``kv_read`` at the mean one (what a step reads),
    both the model's own (kv_cache.sequence_kv); ``shape`` the model's kernels (llm_step.LlmShape).

    Prefill and decode share each replica's time (cost/load.py): throughput, TTFT and the time per output token
    come from the steps that mix them, as the runtime schedules them.

    A Mixture of Experts holds every expert, but a step reads the dense weights and the experts its tokens touch
    (serving.moe_weights_read, uniform routing)."""
    from gpuwise.planning.capture.tracker import CATEGORIES
    from gpuwise.planning.cost.llm_step import chip_of, fp4_capable
    from gpuwise.planning.cost.replica import capacity, layouts
    from gpuwise.planning.cost.runtimes import FP4_BITS, check_formats, runtime

    rt = runtime(traffic.served_by)
    check_formats(rt, traffic.weights, traffic.kv_dtype)
    if not any(acc.peak_tflops.get(k) for k in ("bf16", "fp16", "fp32")):
        return [], "no 16- or 32-bit rate: runs exported int8 graphs only, not a language model's decode"
    if traffic.weights in FP4_BITS and not fp4_capable(acc):
        return [], f"--weights {traffic.weights} needs FP4 tensor cores (Blackwell)"
    if traffic.weights == "fp8" and not acc.fp8 and rt.name == "tensorrt-llm":
        return [], "TensorRT-LLM's fp8 needs fp8 tensor cores (Ada, Hopper, Blackwell)"
    if chip_of(acc) is None:
        return [], "the catalog lacks this chip's bandwidth or rates (the kernel model's facts)"
    params = step.workload.params
    weights = shape.weights_held(traffic.weights, params)
    if step.setup.quantized:  # as captured: the quantised layers and the 16-bit rest, the figure plan shows
        weights = float(step.live[:, CATEGORIES.index("weights")].max())
    live = step.live[int(step.live.sum(axis=1).argmax())]
    activations = float(live.sum() - live[CATEGORIES.index("weights")] - live[CATEGORIES.index("kv_cache")])
    expert_read = None
    if experts is not None:
        from gpuwise.planning.cost.serving import experts_touched

        def expert_read(tokens: float) -> float:
            """The experts a step of ``tokens`` tokens reads, over the top_k one token reads (uniform routing)."""
            t = max(1, round(tokens))
            return experts_touched(experts.experts, experts.top_k, t) / experts.top_k

    tp_given = traffic.tensor_parallel
    counts = [tp_given] if tp_given is not None else [n for n in COUNTS if n <= min(acc.node_gpus,
                                                                                    MAX_TENSOR_PARALLEL,
                                                                                    c.max_gpus or COUNTS[-1])]
    counts = [n for n in counts if n <= acc.node_gpus and (c.max_gpus is None or n <= c.max_gpus)]
    rows: list[Option] = []
    why = ("the weights and one sequence's KV cache do not fit even on a full node" if tp_given is None else
           f"the weights and one sequence's KV cache do not fit on {tp_given} GPUs")
    if tp_given is not None and not counts:
        why = f"--tensor-parallel-size {tp_given} is more than the {min(acc.node_gpus, c.max_gpus or tp_given)} " \
              "GPUs allowed"
    for n in counts:
        best = None
        for layout in layouts(rt, n):
            if traffic.split is not None and n > 1 and layout.split != traffic.split:
                continue
            if tp_given is not None and n > 1 and layout.tp != n:  # --tensor-parallel-size: vLLM's split
                continue
            if layout.tp > 1 and dims.heads % layout.tp:
                why = f"{dims.heads} attention heads do not split over {layout.tp} GPUs"
                continue
            if layout.pp > dims.layers:
                continue
            kv_seq = kv.per_gpu(layout.tp)
            fits = capacity(acc, layout, weight_bytes=weights, activation_bytes=activations,
                            kv_bytes_per_seq=kv_seq, share=traffic.memory_share, kv_block=rt.kv_block,
                            context=traffic.context)
            if fits == 0:
                continue
            most = min(fits, traffic.seqs_limit)
            found = _fit_traffic(shape, acc, rt, layout, traffic, most, expert_read, calibration)
            if isinstance(found, str):
                why = found
                continue
            load, replicas, basis = found
            score = (load.output_tokens_per_s / n, load.decode_tokens_per_s)
            if best is None or score > best[0]:
                best = (score, layout, load, replicas, fits, most, kv_seq, basis)
        if best is None:
            continue
        _, layout, load, replicas, fits, most, kv_seq, basis = best
        if c.max_gpus is not None and replicas * n > c.max_gpus:
            why = f"needs {replicas * n} GPUs ({replicas} replicas of {n}), over --max-gpus {c.max_gpus}"
            continue
        batch = max(1, math.ceil(load.batch))
        share = memory_share(weights / n + activations + most * kv_seq / layout.pp, acc, traffic.memory_share)
        args = vllm_args(max_model_len=traffic.context, memory_share=share, max_num_seqs=most,
                         tensor_parallel=layout.tp, kv_cache_dtype=kv.kv_dtype, weights=traffic.weights,
                         pipeline_parallel=layout.pp) if rt.name == "vllm" else None
        command = runtime_command(rt.name, served_name(model), tp=layout.tp, pp=layout.pp, split=layout.split,
                                  seqs=most, context=traffic.context, weights=traffic.weights,
                                  kv_dtype=kv.kv_dtype)
        s = load.step
        step_basis = (f"{rt.name} ({rt.batching} batching), {layout.describe()}: a step {s.seconds * 1e3:.3g} ms = "
                      f"GEMMs {s.gemm_s * 1e3:.3g} + attention {s.attention_s * 1e3:.3g} + other kernels "
                      f"{s.other_s * 1e3:.3g} + host {s.host_s * 1e3:.3g}"
                      + (f" + all-reduce {s.comm_s * 1e3:.3g}" if s.comm_s else "") + f" ms ({s.bound}-bound) "
                      f"at {load.batch:.3g} sequences; prompts {load.prefill_share:.0%} of the tokens; "
                      f"kernels priced from per-op measurements (cost/kernels.py), {rt.name} constants: {rt.basis}"
                      + (f"; {basis}" if basis else "") + (f"; {load.note}" if load.note else ""))
        rows.append(_served(acc, n, replicas, load.output_tokens_per_s * replicas, load.tpot_s, load.ttft_s, fits,
                            goal, c, step_basis,
                            flags=f"--weights {traffic.weights}" if traffic.weights != "bf16" else "",
                            decode_batch=batch, weight_bytes_read=shape.weights_read(
                                traffic.weights, expert_read=expert_read(batch) if expert_read else 1.0) / n,
                            kv_bytes_per_seq=kv_seq / layout.pp, vllm_args=args, runtime=rt.name,
                            parallel=(("tp", layout.tp), ("pp", layout.pp), ("replicas", replicas)),
                            runtime_command=command or None, prefill_share=load.prefill_share))
    return rows, why


def served_name(model: str) -> str:
    """What a runtime takes for ``model``: a built-in model's Hugging Face repo, else the name as given (a Hub id, or
    a config the user serves from their own path)."""
    from gpuwise.models import MODELS

    zoo = MODELS.get(model)
    return zoo.hub_id if zoo is not None and zoo.hub_id else model


def _fit_traffic(shape, acc: Accelerator, rt, layout, traffic: Traffic, most: int, expert_read,
                 calibration: Calibration | None):
    """(load of one replica, replicas, basis) that serve ``traffic`` within its latency targets, or why not: the
    users spread over as few replicas as hold them (each at most ``most`` sequences), fewer a replica while a
    target is missed; a token rate or a request rate over as many replicas as sustain it."""
    from gpuwise.planning.cost.replica import replica_load

    def load_at(seqs: int, **demand):
        return replica_load(shape, acc, rt, layout, weights=traffic.weights, prompt=traffic.prompt_tokens,
                            output=traffic.output_tokens, seqs=seqs, expert_read=expert_read,
                            calibration=calibration, **demand)

    per = most
    while True:
        if traffic.tokens_per_s is not None or traffic.request_rate is not None:
            load, basis = load_at(per, concurrency=per)  # a replica at its fullest
            if load is None:
                return basis
            if traffic.tokens_per_s is not None:
                replicas = math.ceil(traffic.tokens_per_s / load.output_tokens_per_s)
            else:
                replicas = math.ceil(traffic.request_rate / load.requests_per_s)
                load, basis = load_at(per, rate=traffic.request_rate / replicas)
        else:
            replicas = math.ceil(traffic.concurrency / per)
            load, basis = load_at(per, concurrency=traffic.concurrency / replicas)
            if load is None:
                return basis
        missed = ((traffic.tpot_s is not None and load.tpot_s > traffic.tpot_s)
                  or (traffic.ttft_s is not None and load.ttft_s > traffic.ttft_s))
        if not missed:
            return load, replicas, basis
        if per == 1:
            if traffic.tpot_s is not None and load.tpot_s > traffic.tpot_s:
                return f"{load.tpot_s * 1e3:.3g} ms per output token, over --tpot-ms {traffic.tpot_s * 1e3:g}"
            return f"{load.ttft_s * 1e3:.3g} ms to the first token, over --ttft-ms {traffic.ttft_s * 1e3:g}"
        per = max(1, per // 2)


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
            kv_bytes_per_seq: float | None = None, vllm_args: tuple[str, ...] | None = None,
            runtime: str | None = None, parallel: tuple | None = None, runtime_command: str | None = None,
            prefill_share: float | None = None) -> ServingOption:
    gpus = n * replicas
    hours = None if goal.amount is None else goal.amount / throughput / 3600
    return ServingOption(
        gpu=acc.key, name=acc.name, count=n, fits=True, flags=flags, step_time_s=latency, throughput=throughput,
        mfu=mfu, time_to_goal_s=None if hours is None else hours * 3600, basis=basis, per_user=1 / latency,
        ttft_s=first, max_concurrency=fits, replicas=replicas, decode_batch=decode_batch,
        weight_bytes_read=weight_bytes_read, kv_bytes_per_seq=kv_bytes_per_seq, vllm_args=vllm_args,
        runtime=runtime, parallel=parallel, runtime_command=runtime_command, prefill_share=prefill_share,
        **costs(acc, gpus=gpus, throughput=throughput, hours=hours, rent=c.rent, buy=c.buy, kind=c.rent_kind,
              provider=c.provider).figures())

