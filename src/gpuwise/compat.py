"""Every private PyTorch API gpuwise uses, in one place, with the torch versions each was checked on.

Private names move between releases; when one does, this file is the only one to change. Workarounds for bugs in
the libraries torch bundles live here too. Each entry was checked on torch 2.5, 2.11 (the H200 machine) and 2.13
(CI) unless its comment says otherwise.
"""

from __future__ import annotations

import functools

# Fake tensors: tensors with shapes and dtypes but no storage, so a whole step runs without memory.
# torch._subclasses.fake_tensor since 2.0; DataDependentOutputException is raised by .item() and friends.
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,  # real tensors inside a fake mode (hf_build: constants a constructor reads)
)

try:  # an op whose output shape depends on values (nonzero, unique): in every torch gpuwise supports
    from torch._subclasses.fake_tensor import DynamicOutputShapeException
except ImportError:  # pragma: no cover
    DynamicOutputShapeException = DataDependentOutputException

# Where FakeTensorMode logs a failing op's traceback before re-raising it (the planner reports one line).
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"

# A mode that sees every aten op with its tensors (the planner's memory tracker). Public since 2.x in spirit,
# private in name: torch.utils._python_dispatch. _disable_current_modes runs real tensor code inside a mode (the
# MoE routing stand-in computes its concrete twins with it).
# _get_current_dispatch_mode_stack: the modes active now (quantised MoE experts tell the planner's tracker which of
# their tensors are stand-ins).
from torch.utils._python_dispatch import (  # noqa: E402
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)

# Flatten nested outputs of an op to their tensors. torch.utils._pytree (the public torch.utils.pytree
# appears in 2.6 and is not in 2.5).
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten  # noqa: E402


def fsdp2():
    """``(fully_shard, MixedPrecisionPolicy)``: public in torch.distributed.fsdp from 2.6, under
    torch.distributed._composable.fsdp in 2.5."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.5
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def scaled_mm(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum: bool):
    """An fp8 GEMM (torch._scaled_mm: private in every release to 2.13; its keyword form since 2.5)."""
    import torch

    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


__all__ = ["FAKE_TENSOR_LOGGER", "DataDependentOutputException", "DynamicOutputShapeException", "FakeTensor",
           "FakeTensorMode", "TorchDispatchMode", "_disable_current_modes", "_get_current_dispatch_mode_stack",
           "fsdp2", "scaled_mm", "tree_flatten", "tree_leaves", "tree_map", "tree_unflatten", "unset_fake_temporarily"]


# The float unary ops ATen sends to oneMKL's VML on the CPU (aten/src/ATen/cpu/vml.h, IMPLEMENT_VML_MKL).
VML_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin", "sqrt",
           "tan", "tanh", "trunc")


@functools.cache
def warm_cpu_vml() -> None:
    """Call each VML-backed op once, on one element, on this thread, before any of them runs on several threads.

    oneMKL 2024.2 (the one the torch wheels bundle, 2.10 to 2.13 at least) picks a VML function's kernel on its
    first call. When that first call runs on several intra-op threads at once, which a busy machine makes
    likely, one thread can run a low-accuracy kernel on its whole chunk (pytorch/pytorch#188792: errors to
    ~4000 ulp; fixed in oneMKL 2025). Here it was AdamW's first ``sqrt`` of the second moments: 24,573 of the
    49,152 values of a 384x128 tensor (one thread's half) differed from an identical second call, in 3 of 20
    runs of ``gpuwise train`` under load, so two identical runs (or a resumed one) drifted apart. A one-element
    call runs on the calling thread alone and settles the choice for the whole process (a forked child
    inherits it). Harmless without MKL, and a no-op after the first call."""

    import torch

    if not torch.backends.mkl.is_available():
        return
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for name in VML_OPS:
            getattr(torch, name)(x)
