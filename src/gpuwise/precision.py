"""Precision, decided once: what each ``--precision`` name means, and which one a device gets by default.

Two vocabularies, two tables:

- a *precision* is how a step runs (``bf16-mixed``: fp32 weights, bf16 autocast); ``PRECISIONS`` maps each
  name to its dtypes, the catalog rate that bounds it, whether a GradScaler runs and whether TF32 is on;
- an *element type* is what one tensor holds (``bf16``, ``fp8``): the catalog's rate keys and ``gpuwise
  bench --dtype``; ``ELEMENT_TYPES`` maps each to its torch dtype and width.

Importing this module does not import torch: dtypes are resolved when asked for.

>>> PRECISIONS["fp16-mixed"].scaler, PRECISIONS["fp16-mixed"].rate_key
(True, 'fp16')
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch

Precision = Literal["fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16", "fp8", "fp8-bf16"]


@dataclass(frozen=True, kw_only=True)
class ElementType:
    """One tensor element type as the catalog rates it and bench times it."""

    key: str  # the catalog's rate key: fp32, tf32, fp16, bf16, fp8
    torch_name: str  # attribute of torch: float32, bfloat16, float8_e4m3fn
    bytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.torch_name)


# tf32 is fp32 storage with a 10-bit-mantissa matmul: the same tensors, another rate.
ELEMENT_TYPES: dict[str, ElementType] = {e.key: e for e in (
    ElementType(key="fp32", torch_name="float32", bytes=4),
    ElementType(key="tf32", torch_name="float32", bytes=4),
    ElementType(key="fp16", torch_name="float16", bytes=2),
    ElementType(key="bf16", torch_name="bfloat16", bytes=2),
    ElementType(key="fp8", torch_name="float8_e4m3fn", bytes=1),
)}


@dataclass(frozen=True, kw_only=True)
class PrecisionSpec:
    """One ``--precision``: the dtypes of a step, and what the run must switch on for it."""

    name: Precision
    compute: str  # element type of the matmuls (and of activations under autocast)
    weights: str  # element type of the trainable weights: fp32 master weights under autocast
    autocast: bool  # torch.autocast to ``compute`` over ``weights``
    scaler: bool  # a GradScaler runs (fp16's range needs loss scaling; bf16's does not)
    tf32: bool  # fp32 matmuls may run on TF32 tensor cores
    needs_bf16: bool  # refused on a device without bf16
    rate_key: str  # the catalog's peak rate that bounds the step
    # the linear layers' matmuls in fp8 (torchao's Float8Linear, planning/transforms/float8.py); the rest of the step at
    # ``compute``'s rate
    float8: bool = False

    @property
    def compute_dtype(self) -> torch.dtype:
        return ELEMENT_TYPES[self.compute].torch_dtype

    @property
    def weight_dtype(self) -> torch.dtype:
        return ELEMENT_TYPES[self.weights].torch_dtype

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self.compute_dtype if self.autocast else None


PRECISIONS: dict[str, PrecisionSpec] = {p.name: p for p in (
    PrecisionSpec(name="fp32", compute="fp32", weights="fp32", autocast=False, scaler=False, tf32=False,
                  needs_bf16=False, rate_key="fp32"),
    PrecisionSpec(name="tf32", compute="fp32", weights="fp32", autocast=False, scaler=False, tf32=True,
                  needs_bf16=False, rate_key="tf32"),
    PrecisionSpec(name="bf16-mixed", compute="bf16", weights="fp32", autocast=True, scaler=False, tf32=False,
                  needs_bf16=True, rate_key="bf16"),
    PrecisionSpec(name="fp16-mixed", compute="fp16", weights="fp32", autocast=True, scaler=True, tf32=False,
                  needs_bf16=False, rate_key="fp16"),
    PrecisionSpec(name="bf16", compute="bf16", weights="bf16", autocast=False, scaler=False, tf32=False,
                  needs_bf16=True, rate_key="bf16"),
    # float8 training as torchao runs it (torchtitan's --float8.enable_float8_linear): bf16 autocast over fp32 master
    # weights, as bf16-mixed, with every linear layer but the head multiplying in fp8 (e4m3 forward, e5m2 gradients,
    # tensorwise dynamic scales). fp8 is a GEMM rate, not a storage type: what backward keeps stays bf16.
    PrecisionSpec(name="fp8", compute="bf16", weights="fp32", autocast=True, scaler=False, tf32=False,
                  needs_bf16=True, rate_key="fp8", float8=True),
    # the same over pure bf16 weights: also what one GPU of an FSDP2 fp8 run computes with (bf16 params gathered)
    PrecisionSpec(name="fp8-bf16", compute="bf16", weights="bf16", autocast=False, scaler=False, tf32=False,
                  needs_bf16=True, rate_key="fp8", float8=True),
)}
assert tuple(PRECISIONS) == get_args(Precision)


def default_precision(*, gpu: bool, bf16: bool) -> Precision:
    """The precision a device trains in unless told otherwise: bf16 autocast on a GPU that has bf16 (Ampere
    and later, MI200 and later), fp16 autocast with a scaler on older GPUs, fp32 on CPUs and Apple GPUs."""
    if not gpu:
        return "fp32"
    return "bf16-mixed" if bf16 else "fp16-mixed"


def same_bytes(name: Precision) -> Precision:
    """The precision whose simulated step stores and moves the bytes ``name``'s does: fp16 autocast is bf16
    autocast's twin (2-byte activations over fp32 weights; the scaler's few scalars aside), so one capture serves
    both and the cost model takes the rate from the run's own precision."""
    return "bf16-mixed" if name == "fp16-mixed" else name


def half_precision(*, bf16: bool) -> Precision:
    """The mixed precision that halves a fp32 step's activations on a GPU."""
    return default_precision(gpu=True, bf16=bf16)


@contextlib.contextmanager
def tf32_matmuls(enabled: bool) -> Iterator[None]:
    """TF32 is a process setting of PyTorch, not of the card: set for the block, restored after."""
    import torch

    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
