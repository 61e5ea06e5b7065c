"""What a captured op is to the cost model: its kind (GEMM, attention, memory-bound, no kernel), its kernel family
(how planning/cost/kernels.py prices it) and the (b, m, n, k) shape its kernel runs."""

from __future__ import annotations

import math

import torch

# Op kinds for the cost model: tensor-core GEMMs (matmul, conv), attention kernels (SDPA / gpuwise attention),
# other kernels (elementwise, reductions, norms, optimizer foreach: memory-bound), ops that launch no kernel, and
# fp8 GEMMs (``_scaled_mm``: --precision fp8's linear layers, at the catalog's fp8 rate), and GEMMs whose operands
# are fp32 (in a 16-bit run: MoE experts under autocast, autocast.py; cost/step.py prices them at the fp32 rate).
KINDS = ("matmul", "attention", "other", "none", "matmul-fp8", "matmul-fp32")
MATMUL, ATTENTION, OTHER, NONE, MATMUL_FP8, MATMUL_FP32 = range(6)
# Op families for the kernel-time model (cost/kernels.py): how each kernel is priced. GEMMs (mm, addmm, linear) and
# batched GEMMs (bmm, baddbmm, grouped) by their (b, m, n, k) tiles and waves; convolutions by their implicit GEMM;
# fused attention kernels by their implementation; the rest by the bytes they move, per family.
# "fused": a pointwise or reduction op whose output a compiled kernel keeps in registers (transforms/compiled.py): no
# kernel of its own, only the bytes it reads from memory, moved by the fused kernel it joins
FAMILIES = ("matmul", "bmm", "conv", "attention", "elementwise", "norm", "softmax", "reduction", "optimizer", "copy",
            "none", "fused")
(F_MATMUL, F_BMM, F_CONV, F_ATTENTION, F_ELEMENTWISE, F_NORM, F_SOFTMAX, F_REDUCTION, F_OPTIMIZER, F_COPY,
 F_NONE, F_FUSED) = range(len(FAMILIES))
_FUSIBLE = frozenset({F_ELEMENTWISE, F_NORM, F_SOFTMAX, F_REDUCTION, F_COPY})
# Allocation and metadata ops: the caching allocator hands out memory without a kernel.
_NO_KERNEL = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "set_", "resize_",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_assert_async",
    "_functional_sym_constrain_range", "detach", "alias",
    # --sequence-parallel's collectives (parallel/tensor.py): their output buffer is allocated here, their time on
    # the network priced by cost/comm.py
    "sequence_all_gather", "sequence_reduce_scatter",
})



def op_kind(name: str, flops: int | None, namespace: str, fp32: bool = False) -> int:
    """Which cost class an op falls in: attention kernels, other FLOP-counted ops (GEMMs, convolutions; ``fp32``:
    their operands are fp32), the rest memory-bound; allocation-only ops launch nothing."""
    if "attention" in name:
        return ATTENTION
    if name == "_scaled_mm":
        return MATMUL_FP8
    if flops:
        return MATMUL_FP32 if fp32 else MATMUL
    if name in _NO_KERNEL or namespace in ("prim", "profiler"):
        return NONE
    return OTHER


_NORM = frozenset({"native_layer_norm", "native_layer_norm_backward", "native_batch_norm", "native_batch_norm_backward",
                   "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
                   "_native_batch_norm_legit_no_training", "native_group_norm", "native_group_norm_backward",
                   "_fused_rms_norm", "_fused_rms_norm_backward", "rms_norm", "batch_norm_backward"})
_SOFTMAX = frozenset({"_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data",
                      "_safe_softmax"})
_REDUCTION = frozenset({"sum", "mean", "amax", "amin", "max", "min", "var_mean", "std_mean", "argmax", "argmin", "any",
                        "all", "cumsum", "topk", "sort", "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward",
                        "nll_loss2d_backward", "linalg_vector_norm", "histc", "bincount", "prod", "logsumexp",
                        "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "avg_pool2d", "avg_pool2d_backward",
                        "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "nonzero"})
_COPY = frozenset({"_to_copy", "copy_", "clone", "cat", "stack", "index", "index_put", "index_put_", "index_select",
                   "gather", "scatter", "scatter_add", "scatter_reduce", "embedding", "embedding_dense_backward",
                   "constant_pad_nd", "repeat", "repeat_interleave", "fill_", "zero_", "zeros", "ones", "full",
                   "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "arange",
                   "select_backward", "slice_backward", "expand_copy", "diagonal_backward", "unfold_backward",
                   "_foreach_copy_", "index_add", "index_add_", "_unsafe_view", "lift_fresh_copy", "tril", "triu",
                   "_pin_memory", "scalar_tensor"})
_BMM = frozenset({"bmm", "baddbmm", "_grouped_mm"})
_CONV = frozenset({"convolution", "convolution_backward", "_convolution", "cudnn_convolution",
                   "convolution_overrideable", "convolution_backward_overrideable"})


def op_family(name: str, kind: int, phase: str) -> int:
    """How the kernel-time model prices an op (FAMILIES): GEMMs, batched GEMMs and convolutions by their shapes, fused
    attention by its implementation, the optimizer's kernels and every other memory-bound op by its bytes."""
    if kind == NONE:
        return F_NONE
    if kind == ATTENTION:
        return F_ATTENTION
    if kind in (MATMUL, MATMUL_FP8, MATMUL_FP32):
        return F_CONV if name in _CONV else F_BMM if name in _BMM else F_MATMUL
    if phase == "optimizer":
        return F_OPTIMIZER
    if name in _NORM:
        return F_NORM
    if name in _SOFTMAX:
        return F_SOFTMAX
    if name in _REDUCTION:
        return F_REDUCTION
    if name in _COPY:
        return F_COPY
    return F_ELEMENTWISE


def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else ()


def op_dims(name: str, family: int, args, out) -> tuple[int, int, int, int]:
    """The (b, m, n, k) a GEMM-like kernel runs: b GEMMs of (m, k) x (k, n). A convolution as its implicit GEMM (m =
    N x output pixels, n = output channels a group, k = input channels a group x kernel size, b = groups; backward: the
    forward's), fused attention as its score matrix (b = batch x heads, m = queries, n = keys, k = head size); zeros
    for the other families (or a shape not understood)."""
    try:
        if family == F_MATMUL:
            a, w = (args[1], args[2]) if name in ("addmm",) else (args[0], args[1])
            sa, sw = _shape(a), _shape(w)
            return 1, sa[-2], sw[-1], sa[-1]
        if family == F_BMM:
            if name == "baddbmm":
                args = args[1:]
            sa, sw, so = _shape(args[0]), _shape(args[1]), _shape(out)
            if name == "_grouped_mm":
                groups = so[0] if len(so) == 3 else sw[0]
                if len(sa) == 2 and len(sw) == 2:  # the weights' gradient: (m, tokens) x (tokens, n) per group
                    return groups, so[-2], so[-1], max(1, -(-sa[-1] // groups))
                return groups, max(1, -(-so[-2] // groups)) if len(so) == 2 else so[-2], so[-1], sa[-1]
            return sa[0], sa[-2], sw[-1], sa[-1]
        if family == F_CONV:
            backward = name.startswith("convolution_backward")
            w = args[2] if backward else args[1]
            o = args[0] if backward else (out[0] if isinstance(out, tuple) else out)
            groups = int(args[9] if backward else args[8])
            so, sw = _shape(o), _shape(w)
            return groups, so[0] * math.prod(so[2:]), sw[0] // groups, sw[1] * math.prod(sw[2:])
        if family == F_ATTENTION:
            q, k = (args[1], args[2]) if "backward" in name else (args[0], args[1])
            sq, sk = _shape(q), _shape(k)
            return math.prod(sq[:-2]), sq[-2], sk[-2], sq[-1]
    except (IndexError, TypeError, ValueError, ZeroDivisionError):
        pass
    return 0, 0, 0, 0
