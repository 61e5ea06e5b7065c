"""CUDA behaviour the CPU path does not have, emulated on CPU tensors: autocast's op lists, and dropout.

Attention dropout: CUDA flash attention drops out inside the kernel (keeping an RNG seed and offset);
the CPU flash kernel has no dropout and falls back to the math path, which saves the s x s matrix.
So SDPA runs with dropout_p=0 here: same memory and FLOPs as the GPU kernel.

Dropout: on the CPU ``F.dropout`` multiplies by a noise tensor of the input's dtype and saves it (2 or
4 bytes per element); CUDA runs the fused ``native_dropout`` (aten/src/ATen/native/Dropout.cpp,
``is_fused_kernel_acceptable``), whose mask is bool, 1 byte, as Korthikanti et al. count it.

Autocast:

The plan runs on fake CPU tensors, but CPU autocast keeps different ops in fp32 than CUDA autocast
does: on the CPU ``layer_norm``, ``softmax``, ``log_softmax``, ``exp``, ``pow`` and ``sum`` stay in
bf16, on CUDA they run (and save their outputs) in fp32. Memory follows those dtypes, so we apply
CUDA's op lists ourselves, above autograd as the real autocast does: the casts are recorded by
autograd and their outputs are what backward saves.

Op lists: PyTorch docs, "Automatic Mixed Precision package - torch.amp", sections "CUDA Ops that can
autocast to float16" and "CUDA Ops that can autocast to float32" (unchanged from 2.5 to 2.14).

Grouped matmul (Mixture-of-Experts experts, ``torch._grouped_mm``): not on either list, CUDA autocast leaves its
operands as they are (no AutocastCUDA kernel, pytorch/pytorch#174763), and transformers casts the tokens to the
experts' weight dtype before it (integrations/moe.py ``_grouped_mm``). Under mixed precision the weights are fp32,
so the experts run in fp32: CUDA takes bf16 operands through its CUTLASS kernel and any other float dtype through
a loop of mm per group (aten/src/ATen/native/cuda/GroupedBlas.cpp ``_grouped_mm_fallback``), its output in the
operands' dtype. The fake-tensor rule knows the bf16 kernel only and refuses fp32 ("Expected inputs of BF16
type"): ``grouped_mm`` runs it as CUDA does.

``einsum`` and ``tensordot`` are on neither list: CUDA autocast casts the ``bmm``/``mm`` they decompose into, below
the Python API this mode sees. So an einsum of two or more float tensors (its operands, or one list of them, as CvT
passes) has its operands cast to the lower precision here, as the bmm under it would (ProphetNet, CvT, Perceiver:
an fp32 buffer against bf16 activations fails the fake-tensor bmm's dtype check otherwise).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from gpuwise.compat import FakeTensor, tree_leaves, tree_map

LOWER_PRECISION = frozenset({
    "__matmul__", "__rmatmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul",
    "multi_dot", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "conv_tbc", "GRUCell", "linear", "LSTMCell", "matmul", "mm", "mv", "prelu", "RNNCell",
    "scaled_dot_product_attention", "_convolution", "convolution",
})
FLOAT32 = frozenset({
    "__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
    "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv",
    "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax",
    "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss", "multilabel_margin_loss", "multi_margin_loss",
    "nll_loss", "norm", "normalize", "pdist", "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh",
    "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan",
    "triplet_margin_loss",
})
CONTRACTIONS = frozenset({"einsum", "tensordot"})  # composites whose matmul autocast casts (see above)


def grouped_mm(func, args: tuple, kwargs: dict) -> torch.Tensor:
    """``aten._grouped_mm`` on fake tensors as CUDA runs it: any float dtype, the output in ``out_dtype`` or else
    the first operand's (the fallback's ``_resolve_grouped_mm_out_dtype``). Shapes come from the fake rule, run on
    bf16 copies; called from a dispatch mode's handler, so the copies are not seen by the tracker."""
    a, b = args[0], args[1]
    bf16 = torch.bfloat16
    out_dtype = kwargs.get("out_dtype", args[4] if len(args) > 4 else None)
    if (a.dtype == b.dtype == bf16 and out_dtype in (None, bf16)) or not isinstance(a, FakeTensor):
        return func(*args, **kwargs)

    def to_bf16(x):
        return x.to(bf16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    shaped = func(*map(to_bf16, args[:4]), **{k: to_bf16(v) for k, v in kwargs.items() if k != "out_dtype"})
    return torch.empty_strided(shaped.shape, shaped.stride(), dtype=out_dtype or a.dtype, device=shaped.device)


class CudaEmulation(TorchFunctionMode):
    """Run CPU tensors as CUDA would: dropout through ``native_dropout``, and with ``autocast`` set, cast
    arguments as ``torch.autocast("cuda", autocast)`` does.

    Like CUDA autocast, casts of leaf tensors that require grad (the weights; not their views, as
    aten/src/ATen/autocast_mode.cpp ``cached_cast`` says: ``!arg.is_view()``) are cached for the whole
    forward pass, so each weight is cast once; ``cache=False`` for the recomputation that activation
    checkpointing runs during backward (the real one opens a fresh autocast there). One mode does both:
    checkpointing's early stop raises through the recomputation, and two stacked modes lose their order.
    """

    def __init__(self, autocast: torch.dtype | None = None, *, cache: bool = True) -> None:
        super().__init__()
        self.dtype = autocast
        self.cache = cache
        self._cached: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _cast(self, x: object, dtype: torch.dtype) -> object:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype in (dtype, torch.float64):
            return x
        if self.cache and x.is_leaf and x.requires_grad and x._base is None:  # autocast caches no views
            hit = self._cached.get(id(x))
            if hit is None or hit[0] is not x:
                hit = (x, x.to(dtype))
                self._cached[id(x)] = hit
            return hit[1]
        return x.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "scaled_dot_product_attention" and (kwargs.get("dropout_p") or (len(args) > 4 and args[4])):
            # CUDA flash attention applies dropout inside the kernel and keeps only the RNG seed and offset;
            # the CPU kernel cannot, and would fall back to the math path that saves the s x s matrix.
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs = {**kwargs, "dropout_p": 0.0}
            return self.__torch_function__(func, types, args, kwargs)
        if name == "multi_head_attention_forward":
            return self._multi_head_attention(func, args, kwargs)
        if name == "dropout":
            x = args[0]
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            train = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
            inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
            if train and 0 < p < 1 and not inplace and isinstance(x, torch.Tensor) and x.numel():
                return torch.native_dropout(x, p, True)[0]
        elif self.dtype is not None and name in LOWER_PRECISION:
            args, kwargs = tree_map(lambda x: self._cast(x, self.dtype), (args, kwargs))
        elif self.dtype is not None and name in CONTRACTIONS:
            floats = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            # one operand is a sum or a permute, and nothing summed between two is a product: no matmul to cast
            if len(floats) >= 2 and _contracts(name, args, kwargs):
                args, kwargs = tree_map(lambda x: self._cast(x, self.dtype), (args, kwargs))
        elif self.dtype is not None and name in FLOAT32:
            args, kwargs = tree_map(lambda x: self._cast(x, torch.float32), (args, kwargs))
        return func(*args, **kwargs)

    def _multi_head_attention(self, func, args, kwargs):
        """``F.multi_head_attention_forward`` runs its body with this mode popped, so its inner linear and SDPA
        calls are not seen: cast its inputs and weights as autocast would for those linears, and, when it
        takes the SDPA path (need_weights=False), move dropout into the kernel as CUDA flash attention does."""
        names = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias",
                 "bias_k", "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
                 "key_padding_mask", "need_weights")
        bound = {**dict(zip(names, args, strict=False)), **kwargs}
        rest = args[len(names):]
        if not bound.get("need_weights", True) and bound.get("dropout_p"):
            bound["dropout_p"] = 0.0
        if self.dtype is not None:
            for key in ("query", "key", "value", "in_proj_weight", "in_proj_bias", "bias_k", "bias_v",
                        "out_proj_weight", "out_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
                if key in bound:
                    bound[key] = self._cast(bound[key], self.dtype)
        positional = [bound.pop(n) for n in names[:len(args)] if n in bound] if not rest else list(args)
        return func(*positional, **bound)

    def __exit__(self, *exc):
        self._cached.clear()  # CUDA autocast drops its cast cache when the outermost region exits
        return super().__exit__(*exc)


def _contracts(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether an einsum sums an index shared by two operands: only then does ATen run a bmm under it
    (``sumproduct_pair`` multiplies elementwise where nothing is summed, an outer product say, and autocast leaves
    that ``mul`` in the wider dtype). A tensordot is always an ``mm``, even of no dimensions."""
    if name == "tensordot":
        return True
    equation = args[0] if args and isinstance(args[0], str) else kwargs.get("equation")
    if not isinstance(equation, str):
        return True  # the sublist form: cast, as before
    lhs, arrow, rhs = equation.replace(" ", "").replace("...", "").partition("->")
    terms = lhs.split(",")
    letters = [c for c in lhs if c.isalpha()]
    out = set(rhs) if arrow else {c for c in letters if letters.count(c) == 1}
    return any(c not in out and sum(c in t for t in terms) >= 2 for c in set(letters))
