"""A dispatch-level tracker: the live bytes of every storage, tagged by category, and every op's FLOPs.

It sits under autograd (a ``TorchDispatchMode``), so it sees exactly the tensors that the step
allocates: views share their storage, in-place ops allocate nothing, and a storage is freed when
its last reference goes (a weak reference tells us). Each op that allocates is one *sample* of the
timeline; frees between two samples show in the second one.

GPU-specific behaviour modelled here (the step itself runs on fake CPU tensors):
- the caching allocator rounds every block up to 512 bytes (c10/cuda/CUDACachingAllocator.cpp,
  ``kMinBlockSize``);
- CPU SDPA (``_scaled_dot_product_flash_attention_for_cpu``) keeps the output and an fp32
  logsumexp, exactly what CUDA flash attention keeps; its FLOPs are costed as the GPU kernel's:
  4*b*h*s_q*s_k*d forward, halved when causal (the kernel skips masked tiles), backward 2.5x
  forward (Dao et al. 2022; Dao-AILab/flash-attention#1525). ``FlopCounterMode`` counts 0 for the
  CPU op (pytorch/pytorch#195460) and never halves for causal;
- CUDA flash attention writes its output as (B, T, nh, hs) and returns the (B, nh, T, hs) transpose
  (aten/src/ATen/native/transformers/cuda/attention.cu), so the usual ``y.transpose(1, 2)
  .contiguous()`` after it copies nothing; the CPU kernel returns (B, nh, T, hs) contiguous, and that
  copy would add 2 bytes x s*b*h per layer. We hand autograd the output in the CUDA layout.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.flop_counter import flop_registry

from gpuwise.compat import FakeTensor, TorchDispatchMode, tree_leaves
from gpuwise.errors import GpuwiseError
from gpuwise.planning.capture.autocast import grouped_mm
from gpuwise.planning.capture.families import (  # noqa: F401  (re-exported: the tracker's names since issue 26)
    _FUSIBLE,
    _NO_KERNEL,
    ATTENTION,
    F_ATTENTION,
    F_BMM,
    F_CONV,
    F_COPY,
    F_ELEMENTWISE,
    F_FUSED,
    F_MATMUL,
    F_NONE,
    F_NORM,
    F_OPTIMIZER,
    F_REDUCTION,
    F_SOFTMAX,
    FAMILIES,
    KINDS,
    MATMUL,
    MATMUL_FP8,
    MATMUL_FP32,
    NONE,
    OTHER,
    op_dims,
    op_family,
    op_kind,
)

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "temporaries", "inputs", "kv_cache")
# A storage carries one category for its whole life; a stronger tag wins (an fp32 parameter saved for
# backward stays a weight, a gradient saved by a later op stays a gradient).
_RANK = {c: i for i, c in enumerate(("temporaries", "activations", "kv_cache", "inputs", "gradients", "optimizer",
                                     "weights"))}
ALLOCATOR_ROUND_BYTES = 512
NO_BLOCK = -1  # the block of an op row, or of a storage tagged before the step, that is no block's
IN_STEP = -2  # Storages.home of a storage the step allocated (or first saw)

aten = torch.ops.aten
_DEVICE = torch.ops.prim.device.default

# Ops with no matmul-class FLOPs: the convention of Kaplan et al. and PaLM (and FlopCounterMode) counts
# matrix multiplies and convolutions only; elementwise, norm, softmax and data movement are memory-bound.
_NO_FLOPS = frozenset({
    "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "_amp_foreach_non_finite_check_and_unscale_",
    "_fused_adamw_", "_local_scalar_dense", "_log_softmax", "_log_softmax_backward_data", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training", "_softmax",
    "_softmax_backward_data", "_to_copy", "_unsafe_view", "alias", "amax", "any", "arange", "avg_pool2d",
    "avg_pool2d_backward", "bernoulli_", "cat", "clone", "constant_pad_nd", "copy_", "cumsum", "embedding",
    "embedding_dense_backward", "empty", "empty_like", "empty_strided", "fill_", "full", "full_like", "gather",
    "index", "index_put_", "index_select", "is_same_size", "isinf", "isnan", "lift_fresh", "lift_fresh_copy",
    "linalg_vector_norm", "masked_fill", "masked_fill_", "max", "max_pool2d_with_indices",
    "max_pool2d_with_indices_backward", "mean", "min", "native_batch_norm", "native_batch_norm_backward",
    "native_dropout", "native_dropout_backward", "native_group_norm", "native_group_norm_backward",
    "native_layer_norm", "native_layer_norm_backward", "new_empty", "new_empty_strided", "new_full", "new_ones",
    "new_zeros", "nll_loss_backward", "nll_loss_forward", "nll_loss2d_backward", "nll_loss2d_forward", "normal_",
    "ones", "ones_like", "rand", "randint", "randn", "randperm", "random_", "scalar_tensor", "scatter", "scatter_add",
    "select_backward", "slice_backward", "sort", "stack", "sum", "topk", "uniform_", "where", "zero_", "zeros",
    "zeros_like", "_fused_rms_norm", "_fused_rms_norm_backward", "rms_norm", "resize_", "set_", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "var_mean", "std_mean", "argmax", "argmin", "all",
    "_pin_memory", "item", "nonzero", "repeat", "tril", "triu", "expand_copy", "diagonal_backward",
    "unfold_backward", "_foreach_copy_", "_assert_async", "_functional_sym_constrain_range",
    # Mixture-of-Experts routing and dispatch: counting, sorting and moving tokens, no multiply-adds
    "floor_divide", "histc", "bincount", "index_put", "index_add", "index_add_", "scatter_reduce", "searchsorted",
    "repeat_interleave", "_safe_softmax",
})


PHASES = ("forward", "backward", "optimizer")
_PHASE = {"setup": 0, "forward": 0, "backward": 1, "optimizer": 2}
@dataclass(frozen=True, kw_only=True)
class OpCosts:
    """Every kernel-launching op of a step, device independent: ``sum(flops * count)`` is the step's FLOPs.

    ``count`` weighs each row: micro-batches per optimizer step, and the 2/3-block extrapolation (negative
    weights are allowed there; rows that repeat in both captures cancel)."""

    flops: np.ndarray = field(repr=False)  # float64, per call
    bytes: np.ndarray = field(repr=False)  # float64, read + written per call
    kind: np.ndarray = field(repr=False)  # int8 index into KINDS
    phase: np.ndarray = field(repr=False)  # int8 index into PHASES
    count: np.ndarray = field(repr=False)  # float64 weight
    family: np.ndarray = field(repr=False)  # int8 index into FAMILIES
    dims: np.ndarray = field(repr=False)  # float64 (rows, 4): a GEMM's (b, m, n, k) (op_dims); zeros for the rest

    @classmethod
    def empty(cls) -> OpCosts:
        z = np.zeros(0)
        return cls(flops=z, bytes=z, kind=z.astype(np.int8), phase=z.astype(np.int8), count=z,
                   family=z.astype(np.int8), dims=np.zeros((0, 4)))

    def __len__(self) -> int:
        return len(self.count)

    @property
    def total_flops(self) -> float:
        return float(self.flops @ self.count)

    @property
    def total_bytes(self) -> float:
        return float(self.bytes @ self.count)

    def scaled(self, weight: float) -> OpCosts:
        return dataclasses.replace(self, count=self.count * weight)

    def where(self, mask: np.ndarray) -> OpCosts:
        return OpCosts(flops=self.flops[mask], bytes=self.bytes[mask], kind=self.kind[mask], phase=self.phase[mask],
                       count=self.count[mask], family=self.family[mask], dims=self.dims[mask])

    @staticmethod
    def combine(*parts: OpCosts) -> OpCosts:
        """The parts' rows together, identical rows merged (their weights summed, zero weights dropped)."""
        flops = np.concatenate([p.flops for p in parts])
        nbytes = np.concatenate([p.bytes for p in parts])
        kind = np.concatenate([p.kind for p in parts])
        phase = np.concatenate([p.phase for p in parts])
        count = np.concatenate([p.count for p in parts])
        family = np.concatenate([p.family for p in parts])
        dims = np.concatenate([p.dims for p in parts])
        rows = np.column_stack([flops, nbytes, kind.astype(np.float64), phase.astype(np.float64),
                                family.astype(np.float64), dims])
        if not len(rows):
            return OpCosts.empty()
        unique, inverse = np.unique(rows, axis=0, return_inverse=True)
        summed = np.bincount(inverse.ravel(), weights=count, minlength=len(unique))
        keep = summed != 0
        u = unique[keep]
        return OpCosts(flops=u[:, 0], bytes=u[:, 1], kind=u[:, 2].astype(np.int8), phase=u[:, 3].astype(np.int8),
                       count=summed[keep], family=u[:, 4].astype(np.int8), dims=u[:, 5:9])


@dataclass(frozen=True, kw_only=True)
class OpRows:
    """The costed ops of a capture in the order they ran, one row per call, unweighted and unmerged: two
    captures of the same step at different batch sizes pair row by row (``OpCosts`` merges identical rows)."""

    flops: np.ndarray = field(repr=False)  # int64, per call
    bytes: np.ndarray = field(repr=False)  # int64, read + written per call
    kind: np.ndarray = field(repr=False)  # int8 index into KINDS
    phase: np.ndarray = field(repr=False)  # int8 index into PHASES
    family: np.ndarray = field(repr=False)  # int8 index into FAMILIES
    dims: np.ndarray = field(repr=False)  # int64 (rows, 4): a GEMM's (b, m, n, k) (op_dims); zeros for the rest

    def __len__(self) -> int:
        return len(self.flops)

    def __getitem__(self, index: slice) -> OpRows:
        return OpRows(flops=self.flops[index], bytes=self.bytes[index], kind=self.kind[index], phase=self.phase[index],
                      family=self.family[index], dims=self.dims[index])

    @staticmethod
    def concat(*parts: OpRows) -> OpRows:
        return OpRows(**{f.name: np.concatenate([getattr(p, f.name) for p in parts])
                         for f in dataclasses.fields(OpRows)})

    def same_ops(self, other: OpRows) -> bool:
        """The same op kinds and families in the same phases, call by call (their sizes may differ)."""
        return (len(self) == len(other) and np.array_equal(self.kind, other.kind)
                and np.array_equal(self.phase, other.phase) and np.array_equal(self.family, other.family))

    def costs(self) -> OpCosts:
        """Each row with weight 1, identical rows merged."""
        return OpCosts.combine(OpCosts(flops=self.flops.astype(np.float64), bytes=self.bytes.astype(np.float64),
                                       kind=self.kind, phase=self.phase, count=np.ones(len(self)),
                                       family=self.family, dims=self.dims.astype(np.float64)))


def _sdpa_forward_flops(q: torch.Tensor, k: torch.Tensor, causal: bool) -> int:
    b, h, s_q, d = q.shape
    flops = 4 * b * h * s_q * k.shape[-2] * d  # QK^T and PV, 2 FLOPs per multiply-add
    return flops // 2 if causal and s_q == k.shape[-2] else flops


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> int:
    """``torch._grouped_mm``: one GEMM per group (expert), 2 FLOPs a multiply-add. Forward and the input's gradient
    take (tokens, k) x (experts, k, n) with the tokens split among the experts by the offsets: 2 x tokens x k x n
    whatever the split (every routed token is in a group: transformers' sentinel rows arise only under expert
    parallelism). The weights' gradient takes (k, tokens) x (tokens, n), the tokens split: 2 x k x tokens x n."""
    if a.dim() == 2 and b.dim() == 2:  # (m, tokens) x (tokens, n) -> (groups, m, n)
        return 2 * out.shape[-2] * out.shape[-1] * a.shape[-1]
    return 2 * out.numel() * a.shape[-1]  # (tokens, k) x (g, k, n); (g, m, k) x (k, n); (g, m, k) x (g, k, n)


def op_flops(func, args, kwargs, out) -> int | None:
    """FLOPs of one aten op as the GPU runs it; 0 for memory-bound ops, None for ops we do not know."""
    packet, name, namespace, _ = _op_info(func)
    if packet is aten._scaled_dot_product_flash_attention_for_cpu:
        q, k = args[0], args[1]
        causal = bool(args[4]) if len(args) > 4 else bool(kwargs.get("is_causal", False))
        return _sdpa_forward_flops(q, k, causal)
    if packet is aten._scaled_dot_product_flash_attention_for_cpu_backward:
        # (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, ...)
        causal = bool(args[7]) if len(args) > 7 else bool(kwargs.get("is_causal", False))
        return _sdpa_forward_flops(args[1], args[2], causal) * 5 // 2
    if namespace == "gpuwise":  # gpuwise.ops.attention: the visited tiles' share of the dense work
        if name == "attention_cost":
            return int(_sdpa_forward_flops(args[0], args[1], False) * args[4])
        if name == "attention_cost_backward":  # 7 tile matmuls to the forward's 2: without atomics
            return int(_sdpa_forward_flops(args[1], args[2], False) * args[7] * 7 / 2)  # QK^T and dP run twice
        if name in _NO_KERNEL:  # the emulated collectives
            return 0
    if packet is aten._grouped_mm:
        return _grouped_mm_flops(args[0], args[1], out)
    if packet in (aten.addmm, aten.baddbmm) and len(args) > 3:  # the out_dtype overloads: (self, a, b, out_dtype)
        args = args[:3]
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    if (name in _NO_FLOPS or name.startswith("_foreach_") or func.is_view or torch.Tag.pointwise in func.tags
            or namespace in ("prim", "profiler")):
        return 0
    return None


def _cuda_attention_layout(o: torch.Tensor) -> torch.Tensor:
    """``o`` (B, nh, T, hs) stored as CUDA's kernel stores it: (B, T, nh, hs) memory, transposed."""
    b, h, t, d = o.shape
    cuda = torch.empty((b, t, h, d), dtype=o.dtype, device=o.device).transpose(1, 2)
    return cuda.copy_(o)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# Matmuls and convolutions take floating-point operands only; their fake-tensor rules skip the dtype check the real
# kernels make ("expected m1 and m2 to have the same dtype"), so a plan would say "fits" for a step that cannot run.
# One op past these is a typo in a config (hidden_size 1e9), not a model: 1 PiB, ~10^18 FLOPs (1000x the largest
# step's matmul); the 64-bit timeline would wrap long before a cluster ran it.
_ABSURD_BYTES, _ABSURD_FLOPS = 2**50, 2**60
_FLOAT_ONLY = (aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution)


_INFO: dict[int, tuple] = {}


def _op_info(func) -> tuple:
    """(overload packet, name, namespace, moves data) of an op, computed once: the tracker asks for every op."""
    hit = _INFO.get(id(func))
    if hit is None or hit[0] is not func:
        packet = func._overloadpacket
        namespace = func.namespace
        hit = _INFO[id(func)] = (func, packet, packet.__name__, namespace,
                                 not func.is_view and namespace not in ("prim", "profiler"))  # views move no data
    return hit[1:]


_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors among ``tree``'s leaves, in ``tree_leaves``' order: an op's arguments and outputs are plain
    tuples, lists and dicts, walked here without pytree's cost; anything else is left to ``tree_leaves``."""
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        x = stack.pop()
        kind = type(x)
        if kind is tuple or kind is list:
            stack.extend(reversed(x))
        elif kind is dict:
            stack.extend(reversed(list(x.values())))
        elif isinstance(x, torch.Tensor):
            out.append(x)
        elif kind not in _PLAIN:
            out.extend(t for t in tree_leaves(x) if isinstance(t, torch.Tensor))
    return out


def _run(func, args, kwargs):
    """Run one op: ``_grouped_mm`` in fp32 too, as CUDA runs it (autocast.py); every other as itself."""
    return grouped_mm(func, args, kwargs) if func._overloadpacket is aten._grouped_mm else func(*args, **kwargs)


def _fp32_operands(args) -> bool:
    """The floating-point tensors among an op's first three arguments (a matmul's operands, addmm's bias) are fp32."""
    floats = [t for t in args[:3] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return bool(floats) and all(t.dtype == torch.float32 for t in floats)


def _check_float(func, args) -> None:
    bad = [t for t in args if isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex())]
    if bad:
        dtypes = ", ".join(str(t.dtype).removeprefix("torch.") for t in args if isinstance(t, torch.Tensor))
        raise GpuwiseError(f"aten.{func._overloadpacket.__name__} (nn.Linear, a matmul or a convolution) gets "
                           f"{str(bad[0].dtype).removeprefix('torch.')} operands ({dtypes}): the real step fails "
                           "the same way", "feed floating-point inputs (x.float()), or integer token ids through an "
                           "nn.Embedding first")


class Tracker(TorchDispatchMode):
    """Follow every storage allocated under it; ``timeline()`` gives live bytes per category per sample.

    >>> from gpuwise.compat import FakeTensorMode
    >>> with FakeTensorMode(), Tracker() as tr:
    ...     y = torch.randn(256, 256) @ torch.randn(256, 256)
    >>> tr.flops
    33554432
    """

    def __init__(self, *, round_bytes: int = ALLOCATOR_ROUND_BYTES) -> None:
        super().__init__()
        self.round_bytes = round_bytes
        self.phase = "setup"
        self.block: int | None = None
        self.labels: list[tuple[str, int | None]] = []  # one per sample
        self.ops: list[str] = []  # the op that made each sample
        self._born: list[int] = []
        self._died: list[int] = []
        self._bytes: list[int] = []
        self._category: list[int] = []
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (weak ref, record)
        self.flops_by_op: Counter[str] = Counter()
        self.bytes_by_op: Counter[str] = Counter()
        self.uncosted: Counter[str] = Counter()
        self._op_flops: list[int] = []  # one entry per op that moves data or does arithmetic
        self._op_bytes: list[int] = []
        self._op_kind: list[int] = []
        self._op_phase: list[int] = []
        self._op_family: list[int] = []
        self._op_dims: list[tuple[int, int, int, int]] = []
        self._op_block: list[int] = []  # the block label each op row ran under (-1: none), as samples get theirs
        self.marks: dict[str, int] = {}
        # compiled graphs: storages a fused kernel kept in registers (reading them moves no bytes), and the last
        # op row's outputs (row, storage id -> bytes), which ``discount`` turns into a fused row
        self._fused: dict[int, weakref.ref] = {}
        self._last_out: tuple[int, dict[int, int], str] | None = None
        self.paused = False  # nothing is recorded while set (compiled.py traces a block's graph under it)
        # storage id -> (weak ref, block): in the optimizer step, an op on one block's parameters, gradients or
        # states (and on what such ops made) is labelled with that block, as forward and backward samples are, so
        # that per-parameter optimizer loops scale from 2- and 3-block captures like the blocks themselves
        self._owner: dict[int, tuple[weakref.ref, int]] = {}
        # storage id -> block, for the blocks' parameters, buffers and optimizer states, while step.py tags what
        # exists before the step (Storages.home); None while the step runs
        self.homes: dict[int, int] | None = None
        self._home: list[int] = []

    # --- storages -------------------------------------------------------------------------------
    def _record(self, t: torch.Tensor, category: str) -> int | None:
        st = t.untyped_storage()
        key = id(st)
        hit = self._live.get(key)
        if hit is not None and hit[0]() is st:
            rec = hit[1]
            if _RANK[category] > self._category[rec]:
                self._category[rec] = _RANK[category]
            return None
        rec = len(self._born)
        self._born.append(len(self.labels))
        self._died.append(-1)
        self._bytes.append(st.nbytes())  # as allocated: the allocator's rounding applies in the timeline
        self._category.append(_RANK[category])
        self._home.append(IN_STEP if self.homes is None else self.homes.get(key, NO_BLOCK))
        self._live[key] = (weakref.ref(st, lambda _ref, key=key, rec=rec: self._free(key, rec)), rec)
        return rec

    def _free(self, key: int, rec: int) -> None:
        self._died[rec] = len(self.labels)
        hit = self._live.get(key)
        if hit is not None and hit[1] == rec:
            del self._live[key]

    def tag(self, tensors: Iterable[torch.Tensor | None] | torch.Tensor | None, category: str) -> None:
        """Give ``category`` to the storages behind these tensors (registering any not seen yet)."""
        if tensors is None or self.paused:
            return
        for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
            if isinstance(t, torch.Tensor):
                self._record(t, category)

    def discount(self, tensors: Iterable[torch.Tensor | None] | torch.Tensor | None) -> None:
        """Count the storages behind these tensors as never allocated: a compiled kernel keeps them in registers
        (planning/transforms/compiled.py, inductor's fusion). The op that made them, if it is the last op row, writes
        nothing and launches no kernel of its own (its row becomes "fused"), and ops that read them later read no
        bytes for them."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                hit = self._live.get(id(st))
                if hit is not None and hit[0]() is st:
                    self._bytes[hit[1]] = 0
                self._fused[id(st)] = weakref.ref(st)
                if self._last_out is not None and id(st) in self._last_out[1]:
                    row = self._last_out[0]
                    if self._op_family[row] in _FUSIBLE:
                        kept = self._last_out[1].pop(id(st))
                        self._op_bytes[row] -= kept
                        self.bytes_by_op[self._last_out[2]] -= kept
                        self._op_family[row] = F_FUSED

    def _in_registers(self, t: torch.Tensor) -> bool:
        st = t.untyped_storage()
        ref = self._fused.get(id(st))
        return ref is not None and ref() is st

    def own(self, tensors: Iterable[torch.Tensor | None], block: int) -> None:
        """Mark these tensors' storages as block ``block``'s (see ``_owner``)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self._owner[id(st)] = (weakref.ref(st), block)

    def _block_of(self, leaves: list) -> int | None:
        """The one block whose storages the op reads or writes; None for none or several (foreach over all)."""
        found = set()
        for t in leaves:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                hit = self._owner.get(id(st))
                if hit is not None and hit[0]() is st:
                    found.add(hit[1])
        return found.pop() if len(found) == 1 else None

    def mark(self, name: str) -> None:
        """Remember the current sample (e.g. the end of the forward pass)."""
        self.marks[name] = len(self.labels) - 1

    # --- dispatch -------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and len(args) == 1 and isinstance(args[0], FakeTensor):
            # C++ asks a fake tensor its device through dispatch (autograd's checks, mostly: two dispatches in three
            # of a step); it records nothing, and the tensor answers as FakeTensorMode's handler would
            return args[0].device
        kwargs = kwargs or {}
        if self.paused:
            return _run(func, args, kwargs)
        packet, name, namespace, data = _op_info(func)
        if packet in _FLOAT_ONLY:
            _check_float(func, args)
        out = _run(func, args, kwargs)
        if packet is aten._scaled_dot_product_flash_attention_for_cpu:
            out = (_cuda_attention_layout(out[0]), *out[1:])
        flops = op_flops(func, args, kwargs, out)
        if flops is None:
            self.uncosted[name] += 1
        else:
            self.flops_by_op[name] += flops
        moved = 0
        outs: dict[int, int] = {}
        results = _tensors(out)
        owned = self._owner and self.phase == "optimizer"
        inputs = _tensors((args, kwargs)) if data or owned else []
        if data:
            ins = inputs
            if self._fused:  # a compiled graph: what a fused kernel kept in registers is not read from memory
                ins = [t for t in ins if not self._in_registers(t)]
            for t in results:
                outs[id(t.untyped_storage())] = outs.get(id(t.untyped_storage()), 0) + _nbytes(t)
            moved = sum(_nbytes(t) for t in ins) + sum(outs.values())
            self.bytes_by_op[name] += moved
        if (flops or 0) > _ABSURD_FLOPS or moved > _ABSURD_BYTES:
            raise GpuwiseError(f"one aten.{name} moves {moved:.3g} bytes and does {flops or 0:.3g} FLOPs: more than "
                               "any GPU cluster holds, and past the planner's 64-bit counts",
                               "check the model's sizes (hidden_size, n_embd, intermediate_size, vocab_size)")
        if owned:  # the block this optimizer op works on labels its row and its sample
            self.block = self._block_of(inputs)
        if data or flops:
            self._op_flops.append(flops or 0)
            self._op_bytes.append(moved)
            kind = op_kind(name, flops, namespace, bool(flops) and _fp32_operands(args))
            family = op_family(name, kind, self.phase)
            self._op_kind.append(kind)
            self._op_phase.append(_PHASE[self.phase])
            self._op_family.append(family)
            self._op_dims.append(op_dims(name, family, args, out))
            self._op_block.append(NO_BLOCK if self.block is None or self.block < 0 else self.block)
            self._last_out = (len(self._op_bytes) - 1, outs, name)
        if owned and self.block is not None:
            self.own(results, self.block)
        fresh = False
        for t in results:
            if self._record(t, "temporaries") is not None:
                fresh = True
        if fresh:
            self.labels.append((self.phase, self.block))
            self.ops.append(name)
        return out

    @property
    def flops(self) -> int:
        return sum(self.flops_by_op.values())

    @property
    def bytes_moved(self) -> int:
        """Bytes read and written by the ops so far (inputs + outputs of each)."""
        return sum(self.bytes_by_op.values())

    def op_costs(self, start: int = 0, stop: int | None = None) -> OpCosts:
        """The ops recorded from index ``start`` to ``stop`` (see ``n_ops``), each with weight 1, merged."""
        return self.op_rows()[start:stop].costs()

    def op_rows(self) -> OpRows:
        """Every op recorded so far, in order, unmerged."""
        return OpRows(flops=np.asarray(self._op_flops, dtype=np.int64),
                      bytes=np.asarray(self._op_bytes, dtype=np.int64),
                      kind=np.asarray(self._op_kind, dtype=np.int8), phase=np.asarray(self._op_phase, dtype=np.int8),
                      family=np.asarray(self._op_family, dtype=np.int8),
                      dims=np.asarray(self._op_dims, dtype=np.int64).reshape(-1, 4))

    def op_blocks(self) -> np.ndarray:
        """The block label of every op row recorded so far (-1: none), in order (scaling.fewer_blocks_at)."""
        return np.asarray(self._op_block, dtype=np.int64)

    @property
    def n_ops(self) -> int:
        return len(self._op_flops)

    def storages(self) -> Storages:
        """Every storage seen so far: when it was allocated and freed, its category and size."""
        return Storages(born=np.asarray(self._born, dtype=np.int64), died=np.asarray(self._died, dtype=np.int64),
                        category=np.asarray(self._category, dtype=np.int64),
                        nbytes=np.asarray(self._bytes, dtype=np.int64), round_bytes=self.round_bytes,
                        home=np.asarray(self._home, dtype=np.int64))

    def timeline(self) -> np.ndarray:
        """Live bytes, shape (samples, len(CATEGORIES)); storages that predate the first sample count from it."""
        return self.storages().timeline(len(self.labels))


@dataclass(frozen=True, kw_only=True)
class Storages:
    """The storages of a recorded step, one row each: what the timeline sums, kept so that captures at two
    batch sizes can predict a third storage by storage (each one's size affine in the batch, then rounded)."""

    born: np.ndarray = field(repr=False)  # the sample that allocated it (the first, if it predates them)
    died: np.ndarray = field(repr=False)  # the sample whose op freed it; -1: alive at the end
    category: np.ndarray = field(repr=False)  # rank in _RANK (its strongest tag)
    nbytes: np.ndarray = field(repr=False)  # int64, as allocated (before the allocator's rounding)
    round_bytes: int = ALLOCATOR_ROUND_BYTES
    # the block whose parameter, buffer or optimizer state it holds, for a storage tagged before the step (NO_BLOCK:
    # none of a block's; IN_STEP: allocated, or first seen, while the step ran): what a capture with fewer blocks lacks
    home: np.ndarray | None = field(default=None, repr=False)

    def same_lives(self, other: Storages) -> bool:
        """The same storages, allocated and freed at the same samples, in the same categories."""
        return (self.round_bytes == other.round_bytes and np.array_equal(self.born, other.born)
                and np.array_equal(self.died, other.died) and np.array_equal(self.category, other.category))

    def timeline(self, n: int) -> np.ndarray:
        """Live bytes over ``n`` samples, shape (n, len(CATEGORIES))."""
        delta = np.zeros((n + 1, len(_RANK)), dtype=np.int64)
        born = np.minimum(self.born, n)
        died = np.where(self.died < 0, n, self.died)
        size = self.nbytes
        if self.round_bytes:
            size = -(-size // self.round_bytes) * self.round_bytes
        keep = born < died
        np.add.at(delta, (born[keep], self.category[keep]), size[keep])
        np.add.at(delta, (died[keep], self.category[keep]), -size[keep])
        by_rank = np.cumsum(delta, axis=0)[:n]
        order = [_RANK[c] for c in CATEGORIES]
        return by_rank[:, order]
