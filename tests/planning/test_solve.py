"""``solve``: the longest context, the largest micro-batch and the fewest GPUs that fit, each checked against plans
made apart from the search (the value fits, the next one does not), and the search itself against thresholds set
by hand."""

from __future__ import annotations

import pytest

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import Catalog, load_catalog
from gpuwise.planning.planner import plan
from gpuwise.planning.setup import Request, Setup, resolve
from gpuwise.planning.solve import (
    CONTEXT_GRAIN,
    Probe,
    _max_batch,
    _max_context,
    _min_gpus,
    check_goal,
    solve,
)
from gpuwise.planning.sources.resolve import resolve_source


def _fits_p4(source, setup: Setup) -> bool:
    """Whether ``setup`` fits the 8 GiB Tesla P4, from a plan of its own whose remedies (and their captures) are for
    an H100 it fits: the P4's row of the GPU table decides, as plan decides it for every GPU."""
    catalog = load_catalog()
    p = plan(source, setup, primary="h100-sxm", catalog=Catalog((catalog.get("p4"), catalog.get("h100-sxm"))))
    return next(f for f in p.gpus if f.gpu == "p4").fits


def test_max_context_fits_and_the_next_256_tokens_do_not():
    gpt2 = resolve_source("gpt2", None)  # a prefill of 64 sequences: the logits and the KV cache grow with the context
    s = solve(gpt2, "max-context", Request(task="infer", micro_batch=64), gpu="p4")
    v = s.value
    assert v is not None and v % CONTEXT_GRAIN == 0 and v < 1024  # under GPT-2's positions: memory decided
    assert _fits_p4(gpt2, Setup(task="infer", micro_batch=64, seq=v))
    assert not _fits_p4(gpt2, Setup(task="infer", micro_batch=64, seq=v + CONTEXT_GRAIN))
    assert s.failing.value == v + CONTEXT_GRAIN and s.failing.required_bytes > s.memory_bytes == 8 << 30
    assert s.plan.setup.seq == v and s.plan.fits and s.plan.gpu == "p4" and s.flag == "--seq"
    assert s.probes[0].value == 1024 and len(s.probes) <= 4  # 1,024, then halving, then bisection


def test_max_batch_takes_the_batch_model_and_confirms_it_with_two_captures():
    gpt2 = resolve_source("gpt2", None)
    s = solve(gpt2, "max-batch", Request(task="infer", seq=1024), gpu="p4")
    v = s.value
    assert v is not None and v > 1
    assert _fits_p4(gpt2, Setup(task="infer", micro_batch=v, seq=1024))
    assert not _fits_p4(gpt2, Setup(task="infer", micro_batch=v + 1, seq=1024))
    assert s.failing.value == v + 1 and s.plan.setup.micro_batch == v and s.plan.fits
    assert [p.value for p in s.probes] == [1, v, v + 1]  # the affine model was right: no search beyond it
    assert v == s.plan.max_batch  # the plan's own column agrees


def test_max_context_caps_at_the_models_positions():
    s = solve(resolve_source("gpt2", None), "max-context", Request(task="infer"), gpu="h100-sxm")
    assert (s.value, s.failing, s.plan.setup.seq) == (1024, None, 1024)
    assert "1,024 positions" in s.bound and len(s.probes) == 1


def test_min_gpus_under_fsdp_fits_and_one_gpu_fewer_does_not():
    xl = resolve_source("gpt2-xl", None)
    s = solve(xl, "min-gpus", Request(sharding="fsdp", seq=512), gpu="p4")
    n = s.value
    assert n is not None and n > 2
    assert _fits_p4(xl, Setup(gpus=n, sharding="fsdp", seq=512))
    assert not _fits_p4(xl, Setup(gpus=n - 1, sharding="fsdp", seq=512))
    assert s.failing.value == n - 1 and s.plan.setup.gpus == n and s.plan.setup.sharding == "fsdp"
    assert s.captures <= 4  # one GPU's 2- and 3-block captures, and the sharded run's 16-bit ones for every count


# The search alone, against thresholds set by hand: a prober that fits where the knob is at most ``limit``.

class _Source:
    name = "toy"

    def __init__(self, positions=None):
        self.max_positions = positions

    def check(self, setup):
        pass


class _Threshold:
    """Fits while ``knob(setup) <= limit`` (or ``>=`` for GPU counts); the batch model's guess is ``guess``."""

    def __init__(self, knob, limit, *, at_least=False, guess=0):
        self.knob, self.limit, self.at_least, self.max_batch = knob, limit, at_least, guess
        self.probes: dict[int, Probe] = {}

    def fit(self, value, setup, *, batch_model=False):
        x = self.knob(setup)
        fits = x >= self.limit if self.at_least else x <= self.limit
        return self.probes.setdefault(value, Probe(value=value, fits=fits, required_bytes=0))


@pytest.mark.parametrize(("limit", "positions", "answer", "failing"), [
    (100_000, None, 99_840, 100_096),  # 390 x 256, and the next multiple of 256
    (1024, None, 1024, 1280),
    (1023, None, 768, 1024),
    (200, None, 200, 201),  # below 256: to the token
    (0, None, None, 1),  # not even one token
    (5000, 2048, 2048, None),  # the model's positions cap it
    (1500, 2000, 1280, 1536),
    (1999, 2000, 1792, 2000),  # the cap is the next value past the last multiple
])
def test_context_search_finds_the_threshold_to_the_grain(limit, positions, answer, failing):
    prober = _Threshold(lambda s: s.seq, limit)
    found = _max_context(_Source(positions), Request(), Setup(), prober)
    assert (found.value, found.failing) == (answer, failing)
    assert len(prober.probes) <= 2 * 17  # galloping then bisecting: logarithmic in the answer


def test_decode_context_is_capped_one_below_the_positions():
    prober = _Threshold(lambda s: s.context, 10**9)
    found = _max_context(_Source(4096), Request(task="decode"), Setup(task="decode"), prober)
    assert (found.value, found.failing) == (4095, None) and "one kept for the token" in found.bound


@pytest.mark.parametrize(("limit", "guess", "most"), [
    (37, 37, 3),  # the batch model was right: 1, 37 and 38
    (37, 40, 10),  # it overshot: down from 40, then bisection
    (37, 30, 10),  # it undershot: galloping up from 31, then bisection
    (1, 5, 10),
    (37, 0, 20),  # no batch model (the ops change with the batch): galloping from 1
])
def test_batch_search_confirms_or_corrects_the_linear_guess(limit, guess, most):
    prober = _Threshold(lambda s: s.micro_batch, limit, guess=guess)
    found = _max_batch(_Source(), Request(), Setup(), prober)
    assert (found.value, found.failing) == (limit, limit + 1)
    assert len(prober.probes) <= most


@pytest.mark.parametrize(("need", "batch", "answer", "failing"), [
    (5, None, 5, 4),
    (1, None, 1, None),
    (40_000, None, 40_000, 39_999),
    (5, 24, 6, 4),  # --batch 24 splits over 4 and 6 data-parallel GPUs, not 5
])
def test_sharded_gpu_search_finds_the_fewest_the_flags_allow(need, batch, answer, failing):
    request = Request(sharding="fsdp", batch=batch)
    prober = _Threshold(lambda s: s.gpus, need, at_least=True)
    found = _min_gpus(_Source(), request, check_goal("min-gpus", request), prober)
    assert (found.value, found.failing) == (answer, failing)


def test_gpu_search_under_tp_doubles_the_degree():
    request = Request(tp=2)
    prober = _Threshold(lambda s: s.tp, 8, at_least=True)
    found = _min_gpus(_Source(), request, resolve(request), prober)
    assert (found.value, found.failing) == (8, 4) and list(prober.probes) == [1, 2, 4, 8]


def test_ddp_cannot_shrink_and_says_which_flag_shards():
    prober = _Threshold(lambda s: s.gpus, 2, at_least=True)  # only two GPUs would fit: ddp never gets there
    found = _min_gpus(_Source(), Request(), Setup(), prober)
    assert found.value is None and "--sharding fsdp" in found.reason and list(prober.probes) == [1]


@pytest.mark.parametrize(("goal", "request_", "says"), [
    ("max-context", Request(seq=2048), "drop --seq 2048"),
    ("max-context", Request(task="decode", context=512), "drop --context 512"),
    ("max-batch", Request(batch=8), "drop --batch 8"),
    ("max-batch", Request(micro_batch=2), "drop --micro-batch 2"),
    ("min-gpus", Request(gpus=8, sharding="fsdp"), "drop --gpus 8"),
    ("min-gpus", Request(task="infer"), "recommend --serve"),
    ("max-seq", Request(), "max-context, max-batch, min-gpus"),
])
def test_a_goal_and_the_flag_it_solves_conflict(goal, request_, says):
    with pytest.raises(GpuwiseError) as exc:
        check_goal(goal, request_)
    assert says in str(exc.value)


def test_the_sharded_start_is_the_fewest_gpus_the_flags_take():
    assert check_goal("min-gpus", Request(sharding="fsdp")).gpus == 2
    assert check_goal("min-gpus", Request(sharding="zero2", tp=2)) == resolve(Request(sharding="zero2", tp=2, gpus=4))
