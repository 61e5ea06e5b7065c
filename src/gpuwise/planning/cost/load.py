"""Serving under load: prefill and decode share one replica's GPUs, as the runtime schedules them.

A request brings ``P`` prompt tokens and takes ``O`` output tokens. In a steady state with ``B`` sequences in the
replica:

- continuous batching (vLLM, SGLang, TensorRT-LLM; llama.cpp's slots): every step gives each decoding sequence one
  token and fills the rest of the step's token budget with prompt chunks, so a prompt takes ``c = ceil(P / (budget
  - decoding))`` steps (its first token comes out of the last one) and a sequence stays ``c + O - 1`` steps. A
  step then holds ``B (O - 1) / (c + O - 1)`` decode tokens and ``B P / (c + O - 1)`` prompt tokens, and lasts
  ``s`` (llm_step.step_seconds of that mix). Output tokens/s = ``B O / ((c + O - 1) s)``, the time between tokens
  ``s``, the time to the first token ``c s`` plus any wait for a place (Little's law: users beyond ``B`` wait their
  turn).
- static batching (transformers generate): ``B`` prompts prefilled together, then ``O - 1`` decode steps; the next
  batch starts when the longest sequence ends.
- pipeline (layer split) over ``pp`` GPUs: each GPU runs a ``1/pp`` of the layers; with one stream (llama.cpp) the GPUs
  take turns: a token costs every stage's time plus ``pp - 1`` hand-offs, never less than one GPU's; with
  continuous batching (vLLM) ``pp`` micro-batches are in flight, one per stage.

Given a concurrency (closed loop: each user sends the next request when the last one ends), an arrival rate
(open loop: B solved from Little's law, ``saturated`` past what the replica sustains) or neither (offline: as many
as fit), ``serve_load`` returns the throughput, the per-stream speed, TTFT and the step's makeup.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gpuwise.errors import GpuwiseError
from gpuwise.planning.cost.llm_step import StepCost
from gpuwise.planning.cost.runtimes import Runtime

# step(decode, prefill, prefill_seqs) -> StepCost of one stage (the replica's GPUs in step, a stage when pipelined)
StepFn = Callable[[float, float, float], StepCost]


@dataclass(frozen=True, kw_only=True)
class Load:
    """One replica under its share of the traffic."""

    batch: float  # sequences in the replica at once (mean)
    output_tokens_per_s: float
    total_tokens_per_s: float  # prompt + output tokens processed a second
    requests_per_s: float
    tpot_s: float  # time between a stream's tokens (mean over its decode steps)
    ttft_s: float  # time to the first token: waiting for a place, then the prompt's steps
    decode_tokens_per_s: float  # one stream's speed: 1 / tpot
    step: StepCost  # a steady-state step
    prefill_share: float  # of the replica's time spent on prompt tokens (their share of the step's tokens)
    saturated: bool  # an arrival rate past what the replica sustains: the queue grows without bound
    note: str


def _continuous(step: StepFn, rt: Runtime, b: float, prompt: int, output: int, stages: int, handoff: float,
                pipelined: bool) -> tuple[float, float, float, StepCost]:
    """(seconds a sequence spends from its first prompt step to its last token, time between its tokens, its prompt
    steps, a stage's step) for ``b`` sequences decoding together over ``stages`` stages: ``pipelined`` (continuous
    batching: one micro-batch of b / stages a stage, every stage busy) or taking turns (the whole batch passes each
    stage in turn, one GPU busy at a time)."""
    # a micro-batch holds whole sequences: fewer sequences than stages leave stages idle (they take turns)
    micro = b / min(stages, max(b, 1.0)) if pipelined else b
    budget = max(rt.step_tokens - max(micro - 1, 0.0), 1.0)  # beside the other sequences' decode tokens
    chunks = float(math.ceil(prompt / budget)) if prompt else 0.0
    life = chunks + output - 1 if prompt else float(output)
    d = micro * (output - 1) / life if prompt else micro
    p = micro * prompt / life
    s = step(d, p, micro / life if prompt else 0.0)
    interval = stages * s.seconds + (stages - 1) * handoff
    return life * interval, interval, chunks, s


def serve_load(step: StepFn, rt: Runtime, *, prompt: int, output: int, capacity: int,
               concurrency: float | None = None, rate: float | None = None, burst: int | None = None, pp: int = 1,
               handoff_s: float = 0.0) -> Load:
    """One replica: at most ``capacity`` sequences (memory and the runtime's --max-num-seqs), users at
    ``concurrency`` (closed loop) or requests at ``rate`` a second (open loop), else offline (``capacity`` at once);
    ``burst``: that many requests at once and no more (a benchmark's finite set sent together: their prompts
    first, then their decodes, when they all fit). ``pp``: pipeline stages (layer split), ``handoff_s`` the
    activations' trip between two of them."""
    if capacity < 1:
        raise GpuwiseError("no sequence fits in the replica", "use more GPUs a replica, or a shorter context")
    if output < 1:
        raise GpuwiseError("a request takes at least one output token", "pass --output-tokens 1 or more")
    stages = max(pp, 1)
    # one stream on a layer split (llama.cpp, hf): the stages take turns, micro-batching needs continuous batching
    turns = stages > 1 and rt.batching != "continuous"
    if burst is not None and 1 <= burst <= capacity and rt.batching == "continuous" and prompt:
        return _burst(step, rt, prompt=prompt, output=output, n=burst, stages=stages, handoff=handoff_s)
    if rt.batching == "static":
        return _static(step, rt, prompt=prompt, output=output, capacity=capacity, concurrency=concurrency,
                       rate=rate, stages=stages, handoff=handoff_s)

    def at(b: float):
        return _continuous(step, rt, b, prompt, output, stages, handoff_s, pipelined=not turns)

    saturated, note = False, ""
    if rate is not None:
        top = at(float(capacity))
        most = capacity / top[0]
        if rate >= most:
            b, saturated = float(capacity), True
            note = f"{rate:g} requests/s is more than the {most:.3g} the replica sustains: the queue grows"
        else:  # Little's law: b = rate x time in the replica, solved by bisection (time grows with b)
            lo, hi = 0.0, float(capacity)
            for _ in range(60):
                mid = (lo + hi) / 2
                if rate * at(max(mid, 1e-9))[0] > mid:
                    lo = mid
                else:
                    hi = mid
            b = max(hi, 1e-9)
    else:
        users = capacity if concurrency is None else concurrency
        b = float(min(users, capacity))
    life, interval, chunks, s = at(b)
    requests = b / life
    wait = 0.0
    if rate is None and concurrency is not None and concurrency > capacity:
        wait = (concurrency - capacity) / requests  # the users beyond the places queue a whole turn
    # the first token: the step under way ends (half a step on average), then the prompt's steps, each carrying
    # up to the budget of its tokens beside the running decodes (the last chunk's step samples the first token)
    if prompt:
        chunk = min(float(prompt), max(rt.step_tokens - max(b / stages - 1, 0.0), 1.0))
        first = step(b / stages if not turns else b, chunk, 1.0).seconds
        first = stages * first + (stages - 1) * handoff_s
        ttft = wait + interval / 2 + (chunks - 1) * max(first, interval) + first + rt.request_s
    else:
        ttft = wait + interval + rt.request_s
    tokens = b * output / life
    return Load(batch=b, output_tokens_per_s=tokens, total_tokens_per_s=requests * (prompt + output),
                requests_per_s=requests, tpot_s=interval, ttft_s=ttft, decode_tokens_per_s=1 / interval, step=s,
                prefill_share=prompt / (prompt + output) if prompt else 0.0, saturated=saturated, note=note)


def _static(step: StepFn, rt: Runtime, *, prompt: int, output: int, capacity: int, concurrency: float | None,
            rate: float | None, stages: int, handoff: float) -> Load:
    """transformers generate: a batch of ``b`` prompts prefilled at once, then ``output - 1`` decode steps."""
    users = capacity if concurrency is None else min(concurrency, capacity)
    if rate is not None:
        users = capacity
    b = float(max(1, math.floor(users)))
    # over a layer split the stages take turns: a pass costs every stage's step and the hand-offs between them
    pre = stages * step(0.0, b * prompt, b).seconds + (stages - 1) * handoff if prompt else 0.0
    dec = step(b, 0.0, 0.0)
    per_token = stages * dec.seconds + (stages - 1) * handoff
    batch_s = pre + (output - 1) * per_token + (0.0 if prompt else per_token)
    requests = b / batch_s
    wait = 0.0
    if concurrency is not None and concurrency > capacity:
        wait = (concurrency - capacity) / requests
    saturated = rate is not None and rate >= requests
    return Load(batch=b, output_tokens_per_s=b * output / batch_s, total_tokens_per_s=requests * (prompt + output),
                requests_per_s=requests, tpot_s=per_token, ttft_s=wait + (pre or per_token),
                decode_tokens_per_s=1 / per_token, step=dec, prefill_share=pre / batch_s, saturated=saturated,
                note="static batching: a batch is prefilled together and ends with its longest sequence")


def prefill_seconds(step: StepFn, rt: Runtime, prompt: int, *, stages: int = 1, handoff_s: float = 0.0) -> float:
    """One prompt of ``prompt`` tokens alone (llama-bench's ppN): chunks of the runtime's step budget
    (llama.cpp's --ubatch-size 512) one after another; over ``stages`` layer-split GPUs the chunks pipeline (llama.cpp
    since PR #6017): (chunks + stages - 1) stage steps."""
    if prompt < 1:
        raise GpuwiseError("a prompt of no tokens has no prefill", "pass a prompt of 1 token or more")
    chunk = min(prompt, rt.step_tokens)
    chunks = math.ceil(prompt / chunk)
    stage = step(0.0, float(chunk), 1.0).seconds
    return (chunks + stages - 1) * (stage + (handoff_s if stages > 1 else 0.0))


def _burst(step: StepFn, rt: Runtime, *, prompt: int, output: int, n: int, stages: int, handoff: float) -> Load:
    """``n`` requests arriving together, all of which fit: their prompts fill the steps' token budget until every
    one is in (a prompt's first token comes out of the step that finishes it: on average half-way), then ``output
    - 1`` decode steps of all ``n``; the throughput is the burst's tokens over its whole time."""
    tokens = float(n * prompt)
    steps = math.ceil(tokens / rt.step_tokens)
    per = tokens / steps
    pre = step(0.0, per / stages, per / prompt / stages)
    pre_s = steps * (stages * pre.seconds + (stages - 1) * handoff)
    dec = step(n / stages, 0.0, 0.0)
    interval = stages * dec.seconds + (stages - 1) * handoff
    total = pre_s + (output - 1) * interval
    ttft = pre_s * (steps + 1) / (2 * steps) + rt.request_s
    return Load(batch=float(n), output_tokens_per_s=n * output / total,
                total_tokens_per_s=n * (prompt + output) / total, requests_per_s=n / total, tpot_s=interval,
                ttft_s=ttft, decode_tokens_per_s=1 / interval, step=dec, prefill_share=pre_s / total, saturated=False,
                note=f"a burst of {n} requests: {steps} prompt steps, then {output - 1} decode steps")
