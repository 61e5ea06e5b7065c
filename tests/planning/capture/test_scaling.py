"""From small captures to the full model (planning/capture/scaling.py): 2- and 3-block captures at two batches
predict a direct capture of more blocks at another batch, sample by sample; and the largest batch a timeline fits
against a brute-force search over every batch."""

from __future__ import annotations

import numpy as np
import pytest

from gpuwise.models import get_model
from gpuwise.planning.capture.scaling import Timeline, batch_affine, extrapolate_blocks
from gpuwise.planning.capture.step import capture
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.zoo import ZooSource


@pytest.mark.parametrize("setup", [
    Setup(micro_batch=2, seq=128),
    Setup(micro_batch=1, seq=128, checkpointing="full", grad_accum=2),
    Setup(task="infer", micro_batch=2, seq=128),
    Setup(task="finetune-lora", micro_batch=1, seq=64, qlora=True),
], ids=["train", "checkpointing+accum", "infer", "qlora"])
def test_block_and_batch_scaling_is_exact(setup):
    """2- and 3-block captures at batches b and b+1 predict a 5-block capture at batch 7, sample by sample."""
    src = ZooSource(zoo=get_model("gpt2"))
    b = setup.micro_batch
    tl = {n: batch_affine(capture(src, setup, batch=b, n_layer=n), capture(src, setup, batch=b + 1, n_layer=n))
          for n in (2, 3)}
    direct = capture(src, setup, batch=7, n_layer=5)
    predicted = extrapolate_blocks(tl[2], tl[3], 5)
    assert predicted.labels == direct.labels
    assert predicted.end_of_forward == direct.end_of_forward
    # exact up to the allocator's 512-byte rounding of tensors whose size is not a multiple of it
    np.testing.assert_allclose(predicted.live(7), direct.live, atol=512 * 64)
    assert extrapolate_blocks(tl[2], tl[3], 3).live(b) == pytest.approx(tl[3].live(b))


def test_max_batch_against_a_brute_force_search():
    """Random small timelines (some samples shrinking with the batch): the largest batch up to the limit whose every
    sample's total stays within the capacity, 0 if none, as a search over every batch finds it."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        samples = int(rng.integers(1, 6))
        base = rng.integers(0, 100, size=(samples, 3)).astype(np.float64)
        slope = rng.integers(-5, 20, size=(samples, 3)).astype(np.float64)
        tl = Timeline(labels=(("forward", None),) * samples, base=base, slope=slope, end_of_forward=0)
        capacity, limit = float(rng.integers(0, 1000)), int(rng.integers(1, 64))
        fits = [b for b in range(1, limit + 1) if tl.live(b).sum(axis=1).max() <= capacity]
        assert tl.max_batch(capacity, limit) == max(fits, default=0), (base, slope, capacity, limit)


def test_op_shapes_at_another_batch_match_a_direct_capture():
    """capture_at carries each op's GEMM shape with its FLOPs: the (b, m, n, k) predicted at batch 5 from captures at
    2 and 3 are a direct capture's at 5, row by row (the kernel-time model prices tiles and waves from them)."""
    from gpuwise.planning.capture.scaling import capture_at

    src = ZooSource(zoo=get_model("gpt2"))
    setup = Setup(micro_batch=2, seq=64)
    a, b = (capture(src, setup, batch=n, n_layer=2) for n in (2, 3))
    predicted, direct = capture_at(a, b, 5), capture(src, setup, batch=5, n_layer=2)
    np.testing.assert_array_equal(predicted.rows.family, direct.rows.family)
    np.testing.assert_array_equal(predicted.rows.dims, direct.rows.dims)
    assert (direct.rows.dims[:, 1] == 5 * 64).any()  # some GEMM's m is the tokens of the batch
