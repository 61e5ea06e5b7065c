"""Batches a step can ask for by number, so a resumed run reads exactly what an uninterrupted one would."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CharText:
    """Character-level language modelling on the English text every Python ships (``pydoc_data.topics``,
    about 460 KB): no download. Batch ``k`` is a function of (seed, k) only."""

    seq: int
    seed: int = 1337
    text: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not self.text:
            from pydoc_data.topics import topics

            object.__setattr__(self, "text", "\n".join(topics[k] for k in sorted(topics)))
        chars = sorted(set(self.text))
        object.__setattr__(self, "vocab", chars)
        index = {c: i for i, c in enumerate(chars)}
        object.__setattr__(self, "ids", torch.tensor([index[c] for c in self.text], dtype=torch.long))
        if len(self.ids) <= self.seq + 1:
            raise ValueError(f"the text has {len(self.ids)} characters, too few for sequences of {self.seq}")

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def batch(self, number: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets, (size, seq) each, for batch ``number``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + number)
        starts = torch.randint(len(self.ids) - self.seq - 1, (size,), generator=g)
        rows = starts[:, None] + torch.arange(self.seq + 1)
        window = self.ids[rows]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
