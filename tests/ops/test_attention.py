"""gpuwise.ops: BlockMask against brute-force element masks; the PyTorch path against float64 and gradcheck;
the Triton kernels themselves (interpreted on the CPU: TRITON_INTERPRET=1 is set in conftest before they are
defined; compiled on a GPU), forward and backward, under FlashAttention's test rule: the kernel's error
against a float64 reference is at most twice PyTorch's own same-dtype computation's, plus a rounding floor."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gpuwise.errors import GpuwiseError
from gpuwise.ops import BlockMask, attention
from gpuwise.ops.attention import reference, uses_kernel
from gpuwise.ops.block_mask import EMPTY, FULL, PARTIAL, causal_variant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_KERNEL = uses_kernel(torch.empty(1, 1, 1, 64, device=DEVICE))
needs_kernel = pytest.mark.skipif(not HAS_KERNEL, reason="Triton is not installed (pip install triton)")


# -- BlockMask ---------------------------------------------------------------------------------------------


def _rebuilt(mask: BlockMask) -> np.ndarray:
    """The element mask as the kernels see it: full tiles all on, partial tiles from `masks`, empty off."""
    bs = mask.block_size
    nb, nq, nk = mask.kind.shape
    out = np.zeros((nb, nq * bs, nk * bs), bool)
    for b in range(nb):
        for i in range(nq):
            for j in range(nk):
                tile = {EMPTY: False, FULL: True}.get(int(mask.kind[b, i, j]))
                out[b, i * bs:(i + 1) * bs, j * bs:(j + 1) * bs] = (
                    mask.masks[mask.mask_id[b, i, j]] if tile is None else tile)
    return out[:, :mask.seq_q, :mask.seq_k]


def test_causal_matches_flex_attentions_printed_example():
    """FlexAttention's docs: causal 512 x 512 in blocks of 128 has one partial (diagonal) block per row, 0-3
    full ones, and 37.5% sparsity."""
    m = BlockMask.causal(512, 512, block_size=128)
    t = m.tables()
    assert t.kv_num_blocks.tolist() == [[1, 1, 1, 1]] and t.full_kv_num_blocks.tolist() == [[0, 1, 2, 3]]
    assert m.sparsity == pytest.approx(0.375)
    assert torch.equal(m.to_dense()[0], torch.ones(512, 512, dtype=torch.bool).tril())


@pytest.mark.parametrize("make", [
    lambda: BlockMask.causal(200, block_size=64),
    lambda: BlockMask.causal(100, 300, block_size=64),
    lambda: BlockMask.sliding_window(333, 70, block_size=64),
    lambda: BlockMask.document([0] * 50 + [1] * 100 + [2] * 47, block_size=64),
    lambda: BlockMask.document([[0] * 90 + [1] * 40, [0] * 10 + [1] * 120], block_size=64, causal=True),
    lambda: BlockMask.from_dense(np.random.default_rng(0).random((3, 4)) < 0.5, 128, seq_q=300, seq_k=450),
    lambda: BlockMask.causal(256, block_size=128) | BlockMask.document([0] * 100 + [1] * 156, block_size=128),
    lambda: BlockMask.sliding_window(256, 40, block_size=64) & BlockMask.document([0] * 130 + [1] * 126, 64),
    lambda: BlockMask.document([0] * 30 + [1] * 140 + [0] * 50, block_size=64),  # not in order: no closed form
    lambda: BlockMask.document([0] * 60 + [7] * 10 + [9] * 58, block_size=64, causal=True),
], ids=["causal", "causal-rect", "window", "document", "doc-batch", "dense", "or", "and", "doc-unordered",
        "doc-gaps"])
def test_tables_rebuild_the_element_mask(make):
    mask = make()
    dense = mask.to_dense().numpy()
    assert np.array_equal(_rebuilt(mask), np.broadcast_to(dense, _rebuilt(mask).shape))
    t = mask.tables()
    for b in range(mask.batch):  # the transposed view lists the same tiles
        rows = {(i, int(j)) for i in range(mask.kind.shape[1])
                for j in t.kv_indices[b, i, :t.kv_num_blocks[b, i] + t.full_kv_num_blocks[b, i]]}
        cols = {(int(i), j) for j in range(mask.kind.shape[2])
                for i in t.q_indices[b, j, :t.q_num_blocks[b, j] + t.full_q_num_blocks[b, j]]}
        assert rows == cols == {tuple(x) for x in np.argwhere(mask.kind[b] != EMPTY)}


def test_combinations_are_the_element_wise_operations():
    a = BlockMask.sliding_window(190, 50, block_size=64)
    b = BlockMask.document([0] * 77 + [1] * 113, block_size=64)
    assert torch.equal((a & b).to_dense(), a.to_dense() & b.to_dense())
    assert torch.equal((a | b).to_dense(), a.to_dense() | b.to_dense())
    assert (a & b).sparsity >= max(a.sparsity, b.sparsity)


def test_odd_lengths_do_not_make_whole_tiles_partial():
    m = BlockMask.from_dense([[True, True], [False, True]], 64, seq_q=100, seq_k=70)
    assert (m.kind[0] == np.array([[FULL, FULL], [EMPTY, FULL]])).all()  # the ragged edge is the kernel's job
    assert BlockMask.causal(100, block_size=64).kind[0, 1, 1] == PARTIAL


@pytest.mark.parametrize(("make", "message"), [
    (lambda: BlockMask.causal(128, block_size=96), "block_size 96 is not 64 or 128"),
    (lambda: BlockMask.document(np.zeros((2, 2, 2)), 64), "is not (seq,) or (batch, seq)"),
    (lambda: BlockMask.causal(128, block_size=64) & BlockMask.causal(128, block_size=128), "cannot combine"),
    (lambda: BlockMask.from_dense([[True]], 64, seq_q=200), "does not cover 200 x 64"),
    (lambda: BlockMask.sliding_window(64, 0), "window 0 must be at least 1"),
])
def test_bad_masks_are_one_line_errors(make, message):
    with pytest.raises(GpuwiseError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


# -- the PyTorch path ----------------------------------------------------------------------------------------


def test_reference_is_sdpa_and_has_exact_gradients():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 37, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = BlockMask.causal(37, block_size=64).to_dense()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(reference(q, k, v, mask, 16 ** -0.5), expected, atol=1e-12)
    m = (BlockMask.document([0] * 5 + [1] * 8, block_size=64).to_dense()
         & BlockMask.causal(13, block_size=64).to_dense())
    small = [t.detach()[:1, :, :13, :4].clone().requires_grad_() for t in (q, k, v)]
    small[1], small[2] = (t.detach()[:, :2].clone().requires_grad_() for t in small[1:])  # GQA: 4 heads over 2
    assert torch.autograd.gradcheck(lambda q, k, v: reference(q, k, v, m, 0.3), tuple(small))


def test_fully_masked_rows_give_zeros_and_zero_gradients_not_nan():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 64, requires_grad=True) for _ in range(3))
    rows = torch.ones(64, 64, dtype=torch.bool)
    rows[10:20] = False
    block = BlockMask(64, 64, 64, lambda b, qi, ki: (qi < 10) | (qi >= 20) | (ki < 0))
    assert torch.equal(block.to_dense()[0], rows)
    out = attention(q, k, v, block_mask=block)
    out.sum().backward()
    assert torch.all(out[:, :, 10:20] == 0) and torch.isfinite(q.grad).all() and torch.all(q.grad[:, :, 10:20] == 0)


def test_bad_inputs_are_one_line_errors():
    q = torch.randn(1, 4, 8, 64)
    with pytest.raises(GpuwiseError, match="grouped-query attention needs a divisor"):
        attention(q, torch.randn(1, 3, 8, 64), torch.randn(1, 3, 8, 64))
    with pytest.raises(GpuwiseError, match="the block mask is for 16 x 16, q and k are 8 x 8"):
        attention(q, q, q, block_mask=BlockMask.causal(16, block_size=64))
    with pytest.raises(GpuwiseError, match="must be 4-D"):
        attention(q[0], q[0], q[0])


# -- the Triton kernels -----------------------------------------------------------------------------------


def _same_dtype(q, k, v, mask, scale):
    """PyTorch's own computation in the inputs' dtype (the FlashAttention rule's yardstick)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        m = mask.to(q.device)[:, None]
        p = torch.softmax(s.masked_fill(~m, torch.finfo(s.dtype).min), -1) * (m & m.any(-1, keepdim=True))
    else:
        p = torch.softmax(s, -1)
    return p.to(v.dtype) @ v


def _compare(q, k, v, mask, *, causal=False):
    """Kernel, float64 reference and same-dtype PyTorch: outputs and the three gradients."""
    scale = q.shape[-1] ** -0.5
    full = mask
    if causal:
        c = BlockMask.causal(q.shape[2], k.shape[2], block_size=mask.block_size if mask else 128,
                             variant=causal_variant(causal))
        full = c if mask is None else mask & c
    dense = None if full is None else full.to_dense()
    do = torch.randn_like(q)
    results = {}
    for name, fn, cast in (("kernel", lambda *t: attention(*t, block_mask=mask, causal=causal), None),
                           ("f64", lambda *t: reference(*t, dense, scale), torch.float64),
                           ("torch", lambda *t: _same_dtype(*t, dense, scale), None)):
        leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(do.to(out.dtype))
        results[name] = [out.detach().double(), *(t.grad.double() for t in leaves)]
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        ref = results["f64"][i]
        floor = 2 * ((ref.to(q.dtype).double() + 0.3 - 0.3) - ref).abs().max().item() + 1e-6
        err = (results["kernel"][i] - ref).abs().max().item()
        yardstick = (results["torch"][i] - ref).abs().max().item()
        assert err <= 2 * yardstick + floor, f"{what}: kernel {err:.3g} vs torch {yardstick:.3g} (+{floor:.3g})"
        assert torch.isfinite(results["kernel"][i]).all()


def _qkv(b, h, hk, sq, sk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    return make(b, h, sq, d), make(b, hk, sk, d), make(b, hk, sk, d)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(("case", "mask", "causal", "shape"), [
    ("dense", None, False, (1, 2, 2, 100, 100)),
    ("causal", None, True, (1, 2, 2, 130, 130)),
    ("window", BlockMask.sliding_window(200, 48, block_size=64), False, (1, 2, 1, 200, 200)),
    ("document", BlockMask.document([0] * 70 + [1] * 60 + [2] * 61, block_size=64), False, (1, 2, 2, 191, 191)),
    ("doc-causal-gqa", BlockMask.document([0] * 100 + [1] * 92, block_size=64), True, (1, 4, 2, 192, 192)),
    ("random", BlockMask.from_dense(np.random.default_rng(3).random((3, 4)) < 0.4, 64, seq_q=150, seq_k=201),
     False, (2, 1, 1, 150, 201)),
])
def test_kernel_forward_and_backward_against_float64(dtype, case, mask, causal, shape):
    b, h, hk, sq, sk = shape
    _compare(*_qkv(b, h, hk, sq, sk, 64, dtype), mask, causal=causal)


@needs_kernel
def test_kernel_head_dim_128_block_128_and_rows_with_nothing_to_attend():
    q, k, v = _qkv(1, 2, 1, 140, 140, 128, torch.float16, seed=1)
    empty = np.array([[True, False], [False, False]])  # the second query block sees nothing
    mask = BlockMask.from_dense(empty, 128, seq_q=140, seq_k=140)
    _compare(q, k, v, mask)
    out = attention(q, k, v, block_mask=mask)
    assert torch.all(out[:, :, 128:] == 0)
    _compare(q, k, v, BlockMask.causal(140, block_size=128))


@needs_kernel
def test_kernel_is_deterministic():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 2, 130, 130, 64, torch.float32, seed=2))
    grads = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        attention(q, k, v, causal=True).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_other_head_dims_fall_back_with_one_warning():
    q = torch.randn(1, 2, 20, 32, device=DEVICE)
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    with pytest.warns(UserWarning, match="head_dim 32 has no kernel") if HAS_KERNEL else _nothing():
        out = attention(q, q, q, causal=True)
    assert torch.allclose(out, expected, atol=1e-5)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_sparsity_and_density_count_the_tiles():
    m = BlockMask.causal(1024, block_size=128)
    n = 1024 // 128
    assert m.sparsity == pytest.approx(1 - (n * (n + 1) / 2) / n**2)
    assert m.density == pytest.approx((n * (n + 1) / 2) / n**2)
    assert math.isclose(BlockMask.from_dense(np.eye(4, dtype=bool), 64).density, 0.25)


def test_built_in_models_run_on_the_kernel_with_the_same_results():
    from gpuwise.models.gpt import GPT, GPTConfig
    from gpuwise.models.llama import Llama, LlamaConfig

    idx = torch.randint(50, (2, 70))
    for cls, cfg in ((GPT, GPTConfig(n_layer=1, n_head=2, n_embd=128, vocab_size=50, block_size=70)),
                     # two key heads: Llama's k (rotated, contiguous) and v (a view) have different layouts
                     (Llama, LlamaConfig(n_layer=1, n_head=4, n_kv_head=2, dim=256, ffn_dim=256, vocab_size=50))):
        torch.manual_seed(0)
        ours = cls(cfg.__class__(**{**cfg.__dict__, "attn_impl": "gpuwise"}))
        torch.manual_seed(0)
        sdpa = cls(cfg)
        a, b = ours(idx, idx), sdpa(idx, idx)
        assert a.item() == pytest.approx(b.item(), rel=1e-5)
        a.backward()
        b.backward()
        for (name, p), q in zip(ours.named_parameters(), sdpa.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, atol=1e-5), name


def test_the_planner_costs_only_the_visited_tiles():
    """GPT-2 at seq 1024: causal tiles of 128 visit n(n+1)/2 of n^2 = 64 tiles, density 0.5625, where SDPA's
    causal flash kernel is costed at 0.5. Per layer SDPA's forward + backward is 3.5x the forward's
    4*b*h*s^2*d (FlashAttention's 2.5x backward); ours is 4.5x (its atomic-free backward runs 7 tile
    matmuls to the forward's 2: QK^T and dP are computed twice, once for dK/dV and once for dQ)."""
    from gpuwise.models import get_model
    from gpuwise.planning.capture.workload import simulate
    from gpuwise.planning.setup import Setup
    from gpuwise.planning.sources.zoo import ZooSource

    src = ZooSource(zoo=get_model("gpt2"))
    sdpa = simulate(src, Setup(micro_batch=2, seq=1024), batch_model=False)
    ours = simulate(src, Setup(micro_batch=2, seq=1024, attention="gpuwise"), batch_model=False)
    forward = 4 * 2 * 12 * 1024**2 * 64 * 12
    assert ours.flops_per_step - sdpa.flops_per_step == pytest.approx(forward * (4.5 * 36 / 64 - 3.5 * 0.5),
                                                                      rel=1e-9)
    def peak(w):
        return w.timeline.live(2).sum(axis=1).max()

    assert peak(ours) == peak(sdpa)  # the same outputs and log-sum-exp kept: the same memory
    assert not ours.uncosted


COMPILE_FOR_HOPPER = '''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gpuwise.ops import _kernels as K

ints = ("H", "HK", "GROUP", "SEQ_Q", "SEQ_K", "N_QB", "N_KB", "MASK_BATCH", "TUNE_KEY")
for fn in (K._attn_fwd, K._attn_bwd_dkdv, K._attn_bwd_dq, K._attn_bwd_delta):
    cx = {"BS": 128, "D": 128, "UPCAST": False, "PREC": "tf32", "BLOCK_M": 128, "BLOCK_N": 64}
    cx = {k: v for k, v in cx.items() if k in fn.arg_names}
    sig = {}
    for n in fn.arg_names:
        if n in cx:
            sig[n] = "constexpr"
        elif n.startswith("stride") or n in ints:
            sig[n] = "i32"
        elif n in ("qk_scale", "sm_scale"):
            sig[n] = "fp32"
        elif n in ("LSE", "DELTA"):
            sig[n] = "*fp32"
        elif n == "MASKS":
            sig[n] = "*i8"
        elif n in ("Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV"):
            sig[n] = "*bf16"
        else:
            sig[n] = "*i32"
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8, "num_stages": 3})
    assert compiled.metadata.shared <= 227 * 1024, (fn.__name__, compiled.metadata.shared)
    print(fn.__name__, compiled.metadata.shared)
'''


def test_the_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter runs the kernels' logic, not Triton's code generation: compile the three kernels for
    sm_90 (bf16, head_dim 128) with the ptxas Triton ships, in a process where they are not interpreted."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], capture_output=True, text=True, env=env,
                          timeout=300)
    if "ptxas" in done.stderr and done.returncode != 0 and "not found" in done.stderr.lower():
        pytest.skip("this Triton has no ptxas")
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line.split()[0] for line in done.stdout.splitlines()] == ["_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq",
                                                                      "_attn_bwd_delta"]


@needs_kernel
def test_kernel_with_k_and_v_in_different_layouts_and_transposed_views():
    q, k, v = _qkv(1, 4, 2, 100, 100, 64, torch.float32, seed=4)
    v = v.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, S, H, D) memory
    _compare(q, k, v, None, causal=True)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    _compare(q, k, v, BlockMask.sliding_window(100, 30, block_size=64))


@pytest.mark.skipif(not (HAS_KERNEL and DEVICE == "cpu"), reason="the interpreter's fixed tiles")
@pytest.mark.parametrize("tiles", [(32, 64), (64, 32), (64, 128), (128, 64), (32, 32)])
def test_kernel_sub_tiles_within_a_mask_block(monkeypatch, tiles):
    """On the GPU the autotuner picks tiles smaller than the mask's blocks; run those paths here too (two sequences
    with their own documents, two query heads on one K/V head: each program is one head's, so two are enough)."""
    from gpuwise.ops import _kernels

    monkeypatch.setattr(_kernels, "_fixed", lambda bs: {"BLOCK_M": tiles[0], "BLOCK_N": tiles[1]})
    mask = BlockMask.document([[0] * 100 + [1] * 90, [0] * 30 + [1] * 160], block_size=128)
    _compare(*_qkv(2, 2, 1, 190, 190, 64, torch.float32, seed=5), mask, causal=True)


# -- why the kernels run or not --------------------------------------------------------------------------------


@pytest.fixture
def fresh_kernel_import(monkeypatch):
    """Forget the kernels' import (and why it failed) for one test; restored after it."""
    import importlib
    import sys

    import gpuwise.ops

    att = importlib.import_module("gpuwise.ops.attention")  # the module: gpuwise.ops.attention is the function
    att._load.cache_clear()
    monkeypatch.delitem(sys.modules, "gpuwise.ops._kernels", raising=False)
    monkeypatch.delattr(gpuwise.ops, "_kernels", raising=False)
    yield att
    att._load.cache_clear()


def test_kernel_status_in_this_process_agrees_with_the_dispatch():
    from gpuwise.ops.attention import kernel_status

    used, why = kernel_status()
    assert used is HAS_KERNEL
    if DEVICE == "cpu" and HAS_KERNEL:
        assert "interprets them on the CPU (TRITON_INTERPRET=1" in why


@pytest.mark.parametrize(("missing", "why"), [
    ("triton", "Triton is not installed (pip install triton)"),
    ("triton.language", "Triton does not import (ModuleNotFoundError: "),
])
def test_kernel_status_without_a_working_triton(fresh_kernel_import, monkeypatch, missing, why):
    """Only an ImportError is caught, and what it says is kept: the dispatch then takes the PyTorch path."""
    import sys

    monkeypatch.setitem(sys.modules, missing, None)  # `import <missing>` raises ModuleNotFoundError
    assert fresh_kernel_import._kernels() is None
    used, reason = fresh_kernel_import.kernel_status()
    assert not used and reason.startswith(why)
    q = torch.randn(1, 1, 8, 64)
    assert not uses_kernel(q)
    assert torch.allclose(attention(q, q, q), reference(q, q, q, None, 1 / 8))


def test_kernel_status_on_a_cpu_without_the_interpreter():
    """Compiled kernels need a GPU: without one (and without TRITON_INTERPRET) the reason says so."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import torch; from gpuwise.ops.attention import kernel_status, uses_kernel; "
            "print(kernel_status(), uses_kernel(torch.empty(1, 1, 1, 64)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ("(False, 'torch sees no CUDA GPU (TRITON_INTERPRET=1 runs the kernels "
                                   "interpreted on the CPU)') False")


# -- issue 15: lower-right causal, SDPA's scale and empty inputs, the PyTorch path on SDPA ------------------


def _f64(b, h, hk, sq, sk, d=64, seed=0):
    """float64 leaves on the CPU: the PyTorch path whatever Triton does (no kernel for fp64)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
            for shape in ((b, h, sq, d), (b, hk, sk, d), (b, hk, sk, d))]


@pytest.mark.parametrize(("sq", "sk"), [(1, 200), (70, 200), (150, 100), (100, 100), (3, 130)])
def test_lower_right_causal_mask_is_torchs(sq, sk):
    """torch's causal_lower_right is ``ones(sq, sk).tril(sk - sq)`` (its docstring); tables rebuild it too."""
    m = BlockMask.causal(sq, sk, block_size=64, variant="lower_right")
    expected = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    assert torch.equal(m.to_dense()[0], expected)
    assert np.array_equal(_rebuilt(m)[0], expected.numpy())
    assert BlockMask.causal(1, 4096, variant="lower_right").sparsity == 0.0  # a decode step sees every key


@pytest.mark.parametrize(("sq", "sk"), [(1, 50), (20, 50), (50, 50), (50, 20)])
def test_lower_right_on_the_pytorch_path_is_sdpa_with_causal_bias(sq, sk):
    from torch.nn.attention.bias import CausalVariant, causal_lower_right

    q, k, v = _f64(2, 4, 2, sq, sk)
    out = attention(q, k, v, causal="lower_right")
    dense = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    ref = reference(q, k, v, dense[None], 0.125)  # rows with no key (sq > sk): zeros, as FlashAttention
    assert torch.allclose(out, ref, atol=1e-12)
    assert torch.equal(attention(q, k, v, causal=CausalVariant.LOWER_RIGHT), out)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(grads, torch.autograd.grad(ref.sum(), (q, k, v)),
                                                                  strict=True))
    if sq <= sk:  # torch warns that its bias gives NaN rows past that
        bias = causal_lower_right(sq, sk)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
        assert torch.allclose(out, sdpa, atol=1e-12)
    else:
        assert torch.all(out[:, :, :sq - sk] == 0) and torch.all(grads[0][:, :, :sq - sk] == 0)


@needs_kernel
@pytest.mark.parametrize(("dtype", "shape", "mask"), [
    (torch.float16, (1, 2, 1, 70, 150), None),
    (torch.float32, (1, 2, 2, 1, 130), None),  # one decoded token over a cache
    (torch.bfloat16, (1, 2, 1, 100, 70), None),  # more queries than keys: the first 30 rows see nothing
    (torch.float32, (2, 1, 1, 100, 180),
     BlockMask.from_dense(np.random.default_rng(1).random((2, 3)) < 0.7, 64, seq_q=100, seq_k=180)),
], ids=["fp16", "decode", "bf16-sq>sk", "block-mask"])
def test_kernel_lower_right_forward_and_backward_against_float64(dtype, shape, mask):
    b, h, hk, sq, sk = shape
    _compare(*_qkv(b, h, hk, sq, sk, 64, dtype, seed=6), mask, causal="lower_right")


@pytest.mark.parametrize(("causal", "message", "hint"), [
    ("bottom-rigth", "causal='bottom-rigth' is not True, False, 'upper_left' or 'lower_right'",
     "did you mean causal='lower_right'?"),
    ("yes", "causal='yes' is not True", "causal='lower_right' (decoding with a KV cache"),
    (1, "causal=1 is not True", "pass causal='upper_left'"),
])
def test_bad_causal_values_are_one_line_errors(causal, message, hint):
    q = torch.randn(1, 1, 4, 64)
    with pytest.raises(GpuwiseError) as info:
        attention(q, q, q, causal=causal)
    assert info.value.message.startswith(message) and hint in info.value.hint and "\n" not in str(info.value)
    assert attention(q, q, q, causal="bottom_right").shape == q.shape  # FlashAttention's word is understood
    with pytest.raises(GpuwiseError) as info:
        BlockMask.causal(4, 8, block_size=64, variant="lowr_right")
    assert info.value.message == "variant='lowr_right' is not 'upper_left' or 'lower_right'"
    assert info.value.hint == "did you mean variant='lower_right'?"


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), np.int64(1), torch.tensor(0.3),
                                   torch.tensor(0.3, dtype=torch.float64), np.array(0.3)],
                         ids=["np.float32", "np.float64", "np.int64", "tensor", "tensor64", "ndarray-0d"])
def test_scale_as_sdpa_takes_it_on_both_paths(scale):
    as_float = float(scale.item() if hasattr(scale, "item") else scale)
    for q, k, v in (_qkv(1, 2, 1, 20, 20, 64, torch.float32), _f64(1, 2, 1, 20, 20)):
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=as_float, is_causal=True,
                                                                    enable_gqa=True)
        assert torch.allclose(attention(q, k, v, scale=scale, causal=True), expected, atol=1e-5)


@pytest.mark.parametrize(("scale", "message"), [
    (torch.tensor([0.3]), "scale has shape (1,), not a single number"),
    (torch.tensor(0.3, requires_grad=True), "scale is a tensor that requires grad"),
    ("0.3", "scale '0.3' is not a number"),
    (True, "scale True is not a number"),
    (float("nan"), "scale nan is not finite"),
])
def test_bad_scales_are_one_line_errors(scale, message):
    q = torch.randn(1, 1, 4, 64)
    with pytest.raises(GpuwiseError) as info:
        attention(q, q, q, scale=scale)
    assert info.value.message.startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])  # fp32: the kernel's
@pytest.mark.parametrize(("sq", "sk"), [(0, 50), (30, 0), (0, 0)])
@pytest.mark.parametrize("causal", [False, True, "lower_right"])
def test_zero_lengths_are_sdpas_answers(dtype, sq, sk, causal):
    """No queries: an empty output; no keys: zeros (SDPA's, not NaN); gradients zero, of the inputs' shapes."""
    q, k, v = (torch.randn(1, h, s, 64, dtype=dtype, requires_grad=True) for h, s in ((4, sq), (2, sk), (2, sk)))
    out = attention(q, k, v, causal=causal)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), enable_gqa=True)
    assert out.shape == expected.shape == (1, 4, sq, 64) and out.dtype == dtype
    assert torch.equal(out, expected)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert [g.shape for g in grads] == [t.shape for t in (q, k, v)] and all(torch.all(g == 0) for g in grads)


def test_pytorch_path_runs_sdpas_fused_kernels_where_the_mask_allows(monkeypatch):
    """Dense, top-left causal and an all-visible decode step reach SDPA with no mask tensor; other masks with
    the boolean element mask."""
    import torch.nn.functional as F

    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is not None, kwargs.get("is_causal", False)))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k, v = _f64(1, 2, 1, 40, 40)
    doc = BlockMask.document([0] * 15 + [1] * 25, block_size=64)
    for kwargs, used in (({}, (False, False)), ({"causal": True}, (False, True)),
                         ({"causal": "lower_right"}, (False, True)), ({"block_mask": doc}, (True, False)),
                         ({"block_mask": doc, "causal": True}, (True, False))):
        calls.clear()
        out = attention(q, k, v, **kwargs)
        assert calls == [used], kwargs
        dense = doc.to_dense() if "block_mask" in kwargs else torch.ones(1, 40, 40, dtype=torch.bool)
        if kwargs.get("causal"):
            dense = dense & torch.ones(40, 40, dtype=torch.bool).tril()
        assert torch.allclose(out, reference(q, k, v, dense, 0.125), atol=1e-12)
    calls.clear()
    attention(q[:, :, :1], k, v, causal="lower_right")  # one decoded token sees every key: no mask
    assert calls == [(False, False)]


def test_pytorch_path_builds_each_dense_mask_once(monkeypatch):
    import importlib

    module = importlib.import_module("gpuwise.ops.attention")  # the module: gpuwise.ops.attention is the function
    built = []
    to_dense = BlockMask._dense_numpy
    monkeypatch.setattr(BlockMask, "_dense_numpy", lambda self: built.append(self) or to_dense(self))
    module._MASKS.clear()
    q, k, v = _f64(1, 2, 2, 70, 70)
    doc = BlockMask.document([0] * 30 + [1] * 40, block_size=64)
    for _ in range(3):
        attention(q, k, v, block_mask=doc)
        attention(q[:, :, :20], k, v, causal="lower_right")
    assert len(built) == 2


def test_pytorch_path_under_the_planners_fake_tensors():
    """The planner runs models on fake tensors, which hold no data: the element masks come from NumPy, and
    are not cached (they would be fake)."""
    import importlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    module = importlib.import_module("gpuwise.ops.attention")
    module._MASKS.clear()
    doc = BlockMask.document([0] * 30 + [1] * 40, block_size=64)
    with FakeTensorMode():
        q = torch.randn(1, 2, 70, 64, dtype=torch.float64, requires_grad=True)
        for sq, kwargs in ((70, {"block_mask": doc}), (70, {"causal": True}), (20, {"causal": "lower_right"}),
                           (90, {"causal": "lower_right"})):  # the last: 20 rows with nothing to attend to
            query = torch.randn(1, 2, sq, 64, dtype=torch.float64, requires_grad=True)
            out = attention(query, q, q, **kwargs)
            out.sum().backward()
            assert out.shape == (1, 2, sq, 64) and query.grad.shape == query.shape
    assert len(module._MASKS) == 0


def test_dense_mask_cache_is_bounded_and_forgets_collected_masks():
    import gc
    import importlib

    module = importlib.import_module("gpuwise.ops.attention")
    cache = module._MaskCache(budget_bytes=2 * 100 * 100)
    masks = [BlockMask.document([0] * 50 + [1] * 50, block_size=64) for _ in range(3)]
    for m in masks:
        keep, rows = cache.get(m, torch.device("cpu"))
        assert keep.shape == (1, 1, 100, 100) and rows is None
    assert len(cache) == 2 and cache.nbytes == 2 * 100 * 100  # the least recently used one went
    assert cache.get(masks[2], torch.device("cpu"))[0] is keep  # kept: the same tensor back
    del masks[2], m
    gc.collect()
    assert len(cache) == 1
    big = BlockMask.causal(200, block_size=64)
    assert cache.get(big, torch.device("cpu"))[0].shape == (1, 1, 200, 200) and len(cache) == 1  # not kept
    with cache._lock:  # collected while the cache is busy (a GC pass inside it): dropped at the next use
        masks.clear()
        gc.collect()
        assert len(cache._entries) == 1
    assert len(cache) == 0


def test_pytorch_path_rows_with_nothing_to_attend_give_zeros_and_zero_gradients():
    q, k, v = _f64(1, 2, 1, 64, 64)
    block = BlockMask(64, 64, 64, lambda b, qi, ki: ((qi < 10) | (qi >= 20)) & (ki <= qi))
    out = attention(q, k, v, block_mask=block)
    assert torch.allclose(out, reference(q, k, v, block.to_dense(), 0.125), atol=1e-12)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.all(out[:, :, 10:20] == 0) and torch.all(grads[0][:, :, 10:20] == 0)
    assert all(torch.isfinite(g).all() for g in grads)
