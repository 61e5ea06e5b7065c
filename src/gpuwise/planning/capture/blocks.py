"""Which blocks of a stack are alike, and how few of them a capture needs to stand for all.

A stack of identical blocks (GPT, Llama) is captured with 2 and with 3 blocks (scaling.py). Many stacks are not
identical: DeepSeek-V3 runs 3 dense blocks and then 58 Mixture-of-Experts ones (``first_k_dense_replace``),
Gemma-2 alternates sliding-window and global attention, Gemma-3 has five sliding blocks to each global one, Jamba
and Qwen3-Next put attention in every 8th or 4th block and Mamba or linear attention in the others. Such a stack is
a prefix of ``first`` blocks followed by a unit of ``period`` blocks repeated to the end (the last repeat possibly
cut short): its captures are the stack's own first ``first + 2 * period + tail`` and ``first + 3 * period + tail``
blocks, which differ by one whole unit, so scaling inserts units, not blocks. A stack with no such pattern, or one
too short for it to pay, is captured whole.

What a block is, is read off the real model: built on the meta device, each block's signature is its modules'
classes and plain attributes (``sliding_window``, ``layer_type``, ``is_causal``...) and its parameters' and
buffers' shapes; an attribute that counts the blocks (``layer_idx``) is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

_PLAIN = (bool, int, float, str, type(None))


class Misaligned(Exception):
    """Two captures did not run the same op sequence, or not the blocks asked for, so they cannot be combined."""


@dataclass(frozen=True, kw_only=True)
class Stack:
    """How a stack of ``n_layer`` blocks is captured small: with ``small`` blocks and with ``small + period``, the
    larger one being the smaller with the unit of ``period`` blocks from block ``first`` on inserted. The full stack
    holds ``copies`` of that unit where the larger capture holds one.

    >>> Stack.uniform(32).captured, Stack.uniform(32).copies   # a Llama: 2 and 3 blocks, the middle one x30
    ((2, 3), 30)
    """

    n_layer: int
    first: int = 1
    period: int = 1
    small: int = 2

    @classmethod
    def uniform(cls, n_layer: int) -> Stack:
        return cls(n_layer=n_layer)

    @property
    def captured(self) -> tuple[int, int]:
        return self.small, self.small + self.period

    @property
    def copies(self) -> int:
        return (self.n_layer - self.small) // self.period


def find_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The model's stack of repeated blocks: ``model.blocks``, else its longest ``nn.ModuleList``."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    return max(lists, key=len) if lists else None


def plan_stack(kinds: Sequence[object] | None, n_layer: int | None) -> Stack | None:
    """The captures that stand for a stack of ``n_layer`` blocks of these ``kinds`` (None: all alike), or None
    where the whole model is captured: too few blocks to scale, or no repeating unit that makes scaling cheaper."""
    if n_layer is None:
        return None
    if kinds is None or len(set(kinds)) == 1:
        return Stack.uniform(n_layer) if n_layer > 3 else None
    if len(kinds) != n_layer:
        return None
    best = None
    for period in range(1, n_layer // 4 + 1):
        first = _periodic_from(kinds, period)
        tail = (n_layer - first) % period
        small = first + 2 * period + tail
        # blocks captured (two batch sizes each): scaled only where fewer than the whole stack's
        if 2 * small + period < n_layer and (best is None or small + period < best.small + best.period):
            best = Stack(n_layer=n_layer, first=first + period, period=period, small=small)
    return best


def _periodic_from(kinds: Sequence[object], period: int) -> int:
    """The first block from which ``kinds`` repeats with ``period`` to the end."""
    first = len(kinds) - period
    while first > 0 and kinds[first - 1] == kinds[first - 1 + period]:
        first -= 1
    return max(first, 0)


def signatures(blocks: Sequence[nn.Module]) -> list[tuple]:
    """Each block's structure: its modules' classes and plain attributes, its parameters' and buffers' shapes.
    Attributes that count the blocks (``layer_idx = i``, ``layer_number = i + 1``) are left out."""
    attrs = [{(name, key): value for name, mod in block.named_modules() for key, value in vars(mod).items()
              if not key.startswith("_") and isinstance(value, _PLAIN)} for block in blocks]
    counters = {key for key in set().union(*attrs) if _counts(attrs, key)}
    out = []
    for block, plain in zip(blocks, attrs, strict=True):
        out.append((
            tuple((name, type(mod).__name__) for name, mod in block.named_modules()),
            tuple(sorted((k, repr(v)) for k, v in plain.items() if k not in counters)),
            tuple((name, tuple(t.shape)) for name, t in (*block.named_parameters(), *block.named_buffers())),
        ))
    return out


def _counts(attrs: list[dict], key: tuple[str, str]) -> bool:
    """Whether attribute ``key`` is the block's index plus a constant in every block that has it (Jamba's Mamba
    mixers and attention layers each have a ``layer_idx``), and at least two have it."""
    offsets = {a[key] - i if isinstance(a[key], int) and not isinstance(a[key], bool) else None
               for i, a in enumerate(attrs) if key in a}
    return None not in offsets and len(offsets) == 1 and sum(key in a for a in attrs) > 1


def kinds_of(sigs: Sequence[tuple]) -> tuple[int, ...]:
    """Signatures as small integers, numbered by first appearance: (0, 0, 0, 1, 1, ...)."""
    seen: dict[tuple, int] = {}
    return tuple(seen.setdefault(s, len(seen)) for s in sigs)
