"""Kernels: ``attention`` (block-sparse FlashAttention in Triton, with a PyTorch path) and ``BlockMask``."""

from gpuwise.ops.attention import attention
from gpuwise.ops.block_mask import BlockMask

__all__ = ["BlockMask", "attention"]
