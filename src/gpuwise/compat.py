"""Every private PyTorch API gpuwise uses, in one place, with the torch versions each was checked on.

Private names move between releases; when one does, this file is the only one to change. Each entry
was checked on torch 2.5, 2.11 (the H200 machine) and 2.13 (CI) unless its comment says otherwise.
"""

from __future__ import annotations

# Fake tensors: tensors with shapes and dtypes but no storage, so a whole step runs without memory.
# torch._subclasses.fake_tensor since 2.0; DataDependentOutputException is raised by .item() and friends.
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode

# Where FakeTensorMode logs a failing op's traceback before re-raising it (the planner reports one line).
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"

# A mode that sees every aten op with its tensors (the planner's memory tracker). Public since 2.x in spirit,
# private in name: torch.utils._python_dispatch.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# Flatten nested outputs of an op to their tensors. torch.utils._pytree (the public torch.utils.pytree
# appears in 2.6 and is not in 2.5).
from torch.utils._pytree import tree_leaves, tree_map  # noqa: E402


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


__all__ = ["FAKE_TENSOR_LOGGER", "DataDependentOutputException", "FakeTensor", "FakeTensorMode",
           "TorchDispatchMode", "fsdp2", "scaled_mm", "tree_leaves", "tree_map"]
