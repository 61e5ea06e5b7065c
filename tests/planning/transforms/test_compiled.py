"""``--compile``: each block as AOTAutograd's min-cut partitioner splits it and inductor fuses it (compiled.py).

Independent checks: what a compiled block keeps between forward and backward is read from the partitioned forward
graph itself (its outputs beyond the block's result), not from the planner's tracker; and the traced graphs run on
real tensors give eager's loss and gradients.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import gpuwise.planning.transforms.compiled as compiled
from gpuwise.errors import GpuwiseError
from gpuwise.models import get_model
from gpuwise.models.llama import Llama, LlamaConfig
from gpuwise.planning.capture.step import capture
from gpuwise.planning.capture.tracker import ALLOCATOR_ROUND_BYTES, CATEGORIES
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.zoo import ZooSource

B, S, DIM, HEADS, KV_HEADS, FFN, VOCAB = 2, 64, 128, 4, 2, 256, 97
CFG = LlamaConfig(n_layer=2, n_head=HEADS, n_kv_head=KV_HEADS, dim=DIM, ffn_dim=FFN, vocab_size=VOCAB)
TINY = ZooSource(zoo=replace(get_model("llama3-8b"), config=CFG, default_seq=S))
ACT = CATEGORIES.index("activations")


def _capture(n_layer: int, **kw):
    return capture(TINY, Setup(micro_batch=B, seq=S, optimizer="sgd", **kw), batch=B, n_layer=n_layer)


def _rounded(nbytes: int) -> int:
    return -(-nbytes // ALLOCATOR_ROUND_BYTES) * ALLOCATOR_ROUND_BYTES


@pytest.fixture(scope="module")
def captures():
    runs = [("none", True, 2), ("none", True, 3), ("none", False, 2), ("none", False, 3), ("selective", False, 3),
            ("selective", True, 3)]
    return {(ck, comp, n): _capture(n, checkpointing=ck, compile=comp) for ck, comp, n in runs}


def _forward_graph() -> torch.fx.GraphModule:
    """The partitioned forward graph of the tiny block (bf16-mixed, no checkpointing): the trace of this file's own
    setup (a key's context is the Setup's repr), whatever else the session traced (inference, other models, --tp)."""
    context = repr(Setup(micro_batch=B, seq=S, optimizer="sgd", compile=True))
    if not any(key[0][3] == context for key in compiled._TRACES):
        _capture(2, compile=True)
    return next(fn for key, fn in compiled._TRACES.items() if key[0][3] == context).graphs[0]


def _kept(c) -> int:
    return int(c.live[c.end_of_forward, ACT])


def test_a_compiled_block_keeps_what_the_partitioner_saves(captures):
    """One more block keeps, at the end of forward, the partitioned forward graph's saved outputs (read from the graph,
    each storage rounded as the allocator does) plus its output (the next layer's input, which that layer saves)."""
    fw = _forward_graph()
    saved = compiled.saved_bytes(fw, rounding=ALLOCATOR_ROUND_BYTES)
    block_output = _rounded(B * S * DIM * 4)  # fp32 residual stream under bf16-mixed
    one_block = _kept(captures["none", True, 3]) - _kept(captures["none", True, 2])
    print(f"\ncompiled block keeps {one_block:,} B; partitioner saves {saved:,} B + output {block_output:,} B")
    assert one_block == saved + block_output


def test_compile_keeps_less_and_peaks_lower_with_the_same_flops(captures):
    for ck in ("none", "selective"):
        eager, comp = captures[ck, False, 3], captures[ck, True, 3]
        assert _kept(comp) <= _kept(eager), ck
        # A compiled block's backward returns all its weight gradients together (graph outputs), where eager
        # accumulates each as it comes: under selective checkpointing that can outweigh the smaller saved set.
        limit = 1.0 if ck == "none" else 1.01
        assert comp.live.sum(axis=1).max() <= limit * eager.live.sum(axis=1).max(), ck
        # the min-cut partitioner recomputes only pointwise ops (no FLOPs); selective recomputes what eager does
        assert comp.flops_per_step == eager.flops_per_step, ck
    assert _kept(captures["none", True, 3]) < 0.9 * _kept(captures["none", False, 3])


def test_a_trace_shared_with_an_earlier_capture_counts_the_same():
    """Captures reuse traced blocks (the same structure, inputs and setup): the reused graphs report to the new
    capture's tracker, and nothing the first capture traced with stays alive in the second."""
    compiled._TRACES.clear()
    cold, warm = _capture(2, compile=True), _capture(2, compile=True)
    assert cold.labels == warm.labels
    assert (cold.live == warm.live).all()
    assert cold.live[-1, ACT] == 0  # nothing saved outlives backward


def test_fusion_leaves_out_the_norms_intermediates():
    """RMSNorm's x^2 and its mean stay inside one kernel; a matmul's output always materialises."""
    fused = compiled.fused_away(_forward_graph().graph)
    ops = {n.target for n in fused}
    assert torch.ops.aten.pow.Tensor_Scalar in ops and torch.ops.aten.mean.dim in ops
    assert not any(n.target is torch.ops.aten.mm.default for n in fused)


def test_fused_ops_launch_nothing_and_move_only_what_they_read(captures):
    """An op whose output inductor keeps in registers is no kernel of its own ("fused"): it neither writes that output
    nor is read back from memory by the next op of its kernel. One block's rows (3-block capture less the 2-block
    one): the compiled block moves fewer bytes, through fewer kernels, with the same FLOPs, and the bytes it no longer
    moves are at least the fused-away outputs' one write each, read from the traced graph itself."""
    from gpuwise.planning.capture.tracker import F_FUSED, F_NONE

    def block(comp: bool):
        big, small = captures["none", comp, 3].costs, captures["none", comp, 2].costs
        kernels = lambda c: float(c.count[(c.family != F_FUSED) & (c.family != F_NONE)].sum())  # noqa: E731
        return (float(big.bytes @ big.count - small.bytes @ small.count), kernels(big) - kernels(small),
                float((big.count * (big.family == F_FUSED)).sum() - (small.count * (small.family == F_FUSED)).sum()))

    (eager_bytes, eager_kernels, eager_fused), (comp_bytes, comp_kernels, comp_fused) = block(False), block(True)
    assert eager_fused == 0 and comp_fused > 0
    assert comp_kernels < eager_kernels
    fw = _forward_graph()
    written = sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in compiled.fused_away(fw.graph)
                  if isinstance(n.meta.get("val"), torch.Tensor))
    assert written > 0 and eager_bytes - comp_bytes >= written
    assert captures["none", True, 3].flops_per_step == captures["none", False, 3].flops_per_step


def test_full_checkpointing_inside_the_graph_keeps_the_block_inputs():
    eager, comp = _capture(2, checkpointing="full"), _capture(2, checkpointing="full", compile=True)
    rng_state = 2 * _rounded(16)  # each block's saved generator state for the recomputed attention
    assert _kept(comp) == _kept(eager) + rng_state
    assert comp.flops_per_step == eager.flops_per_step


def test_traced_graphs_run_for_real_as_eager_does():
    """The compiled blocks on real CPU tensors: eager's loss and gradients (float32, no autocast)."""
    torch.manual_seed(0)
    cfg = replace(CFG, n_layer=2)
    model = Llama(cfg)
    twin = copy.deepcopy(model)
    compiled.apply_compile(twin.blocks, context="real fp32")
    idx = torch.randint(0, VOCAB, (B, 16))
    targets = torch.randint(0, VOCAB, (B, 16))
    losses = []
    for m in (model, twin):
        loss = m(idx, targets)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1])
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_compile_is_for_training_and_inference_not_decode():
    """A decode step updates its KV cache in place, which a traced graph would copy whole: refused, naming the fix
    (an inference forward compiles: test_compiled_inference.py)."""
    with pytest.raises(GpuwiseError, match="--compile with --task decode") as e:
        Setup(task="decode", compile=True)
    assert "drop --compile" in e.value.hint
    assert Setup(task="infer", compile=True).compile
    assert "compiled blocks" in Setup(compile=True).describe()
