"""Batches a step can ask for by number, so a resumed run reads exactly what an uninterrupted one would.

Two kinds of source feed the Trainer:

- *numbered* sources (``batch(number, size)`` returns the step's whole global batch as a function of the
  seed and the number): the character text, synthetic images, a model's own example inputs;
- a user's ``torch.utils.data.Dataset``, read by a ``DataLoader`` (pinned memory on GPUs, worker processes)
  through :class:`StepSampler`, which draws each step's global batch from a seeded permutation per epoch
  and hands each process its slice of it (the distributed sampler: together the processes read exactly
  the batch one process would).

Either way :func:`stream` yields, from a given step on, this process's share of each step's batch.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from gpuwise.compat import warm_cpu_vml
from gpuwise.errors import GpuwiseError, first_line


@dataclass(frozen=True)
class CharText:
    """Character-level language modelling on the English text every Python ships (``pydoc_data.topics``,
    about 460 KB): no download. Every tenth 4 KB chunk is held out (``split="val"``) for evaluation, so
both splits sample the whole text.
    Batch ``k`` is a function of (seed, k) only."""

    seq: int
    seed: int = 1337
    split: str = "train"
    text: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.split not in ("train", "val"):
            raise ValueError(f"split {self.split!r} is not train or val")
        if not self.text:
            from pydoc_data.topics import topics

            object.__setattr__(self, "text", "\n".join(topics[k] for k in sorted(topics)))
        chars = sorted(set(self.text))
        object.__setattr__(self, "vocab", chars)
        index = {c: i for i, c in enumerate(chars)}
        chunks = [self.text[i:i + 4096] for i in range(0, len(self.text), 4096)]  # every 10th is held out
        part = "".join(c for i, c in enumerate(chunks) if (i % 10 == 9) == (self.split == "val"))
        object.__setattr__(self, "ids", torch.tensor([index[c] for c in part], dtype=torch.long))
        if len(self.ids) <= self.seq + 1:
            raise ValueError(f"the text has {len(self.ids)} characters, too few for sequences of {self.seq}")

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def batch(self, number: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets, (size, seq) each, for batch ``number``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + number + (0 if self.split == "train" else 1 << 40))
        starts = torch.randint(len(self.ids) - self.seq - 1, (size,), generator=g)
        rows = starts[:, None] + torch.arange(self.seq + 1)
        window = self.ids[rows]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


@dataclass(frozen=True)
class SyntheticImages:
    """Images to classify with nothing to download: each class is a fixed random pattern (from the seed),
    each image its class's pattern plus Gaussian noise of ``noise`` times the pattern's spread. Learnable,
    but not from one pixel. ``split="val"`` draws other images of the same classes."""

    classes: int = 10
    size: int = 32
    channels: int = 3
    noise: float = 1.5
    seed: int = 1337
    split: str = "train"

    def batch(self, number: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        patterns = torch.randn(self.classes, self.channels, self.size, self.size,
                               generator=torch.Generator().manual_seed(self.seed))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + number + (0 if self.split == "train" else 1 << 40))
        labels = torch.randint(self.classes, (size,), generator=g)
        images = patterns[labels] + self.noise * torch.randn(size, self.channels, self.size, self.size, generator=g)
        return images, labels


@dataclass(frozen=True)
class Fixed:
    """The same inputs every step: a model function's example batch, when no ``--data`` is given."""

    inputs: tuple[torch.Tensor, ...]

    def batch(self, number: int, size: int) -> tuple[tuple[torch.Tensor, ...], None]:
        rows = self.inputs[0].shape[0]
        if size != rows:
            raise GpuwiseError(f"the model function's example inputs hold {rows} rows, the batch is {size}",
                               "pass --data file.py:function for real data, or --batch equal to the example batch")
        return self.inputs, None


class StepSampler(torch.utils.data.Sampler):
    """Index lists, one per step from ``start``: step k's global batch is positions [k*B, (k+1)*B) of the
    concatenated per-epoch permutations (seeded by seed and epoch); this process takes its contiguous slice."""

    def __init__(self, length: int, batch: int, *, seed: int, start: int, steps: int, rank: int = 0,
                 world_size: int = 1) -> None:
        if length < 1:
            raise GpuwiseError("the dataset is empty", "return a Dataset with at least one item")
        self.length, self.batch, self.seed, self.start, self.steps = length, batch, seed, start, steps
        self.rank, self.world_size = rank, world_size

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))

    def global_batch(self, step: int) -> list[int]:
        first, out = step * self.batch, []
        while len(out) < self.batch:
            epoch, offset = divmod(first + len(out), self.length)
            order = self._order(epoch)
            out.extend(order[offset:offset + self.batch - len(out)].tolist())
        return out

    def __iter__(self) -> Iterator[list[int]]:
        share = self.batch // self.world_size
        for step in range(self.start, self.steps):
            yield self.global_batch(step)[self.rank * share:(self.rank + 1) * share]

    def __len__(self) -> int:
        return max(self.steps - self.start, 0)


def _split_item(batch: Any) -> tuple[Any, Any]:
    """A collated Dataset batch: ``(inputs, target)`` pairs, inputs alone (the model returns the loss), or a dict
    of keyword inputs (Hugging Face's input_ids, attention_mask, labels)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        x, y = batch[0], batch[1]
    elif isinstance(batch, (tuple, list)) and len(batch) == 1:
        x, y = batch[0], None
    elif isinstance(batch, (torch.Tensor, Mapping)):
        x, y = batch, None
    else:
        size = f" of {len(batch)}" if hasattr(batch, "__len__") else ""
        raise GpuwiseError(f"the dataset's items collate to {type(batch).__name__}{size}",
                           "return (input, target) pairs, single tensors or dicts of tensors from __getitem__")
    for part, what in ((x, "input"), (y, "target")):
        bad = _not_tensor(part)
        if bad is not None:
            raise GpuwiseError(f"the dataset's {what}s hold {bad}, not tensors",
                               "turn them into tensors in __getitem__ (tokenize text there)")
    return tuple(x) if isinstance(x, list) else x, y


def _not_tensor(x: Any) -> str | None:
    """What in a collated batch is not a tensor (``"str ('hello', ...)"``), None when all of it is."""
    if x is None or isinstance(x, torch.Tensor):
        return None
    if isinstance(x, Mapping):
        return next((f"{bad} under {k!r}" for k, v in x.items() for bad in [_not_tensor(v)] if bad), None)
    if isinstance(x, (tuple, list)) and x and not isinstance(x[0], str):
        return next((bad for bad in map(_not_tensor, x) if bad), None)
    sample = x[0] if isinstance(x, (tuple, list)) and x else x
    return f"{type(sample).__name__} ({str(sample)[:20]!r}{', ...' if isinstance(x, (tuple, list)) else ''})"


@dataclass
class DatasetBatches:
    """A user's map-style Dataset, read through a DataLoader with :class:`StepSampler`."""

    dataset: torch.utils.data.Dataset
    seed: int = 1337
    workers: int = 0
    length: int = field(init=False, default=0)  # len(dataset), read once and checked (dataset_length)

    def __post_init__(self) -> None:
        if not hasattr(self.dataset, "__len__") or not hasattr(self.dataset, "__getitem__"):
            raise GpuwiseError(f"--data returned {type(self.dataset).__name__}, not a map-style Dataset",
                               "return a torch.utils.data.Dataset with __len__ and __getitem__")
        self.length = dataset_length(self.dataset)

    def loader_settings(self, *, pin: bool):
        """How ``stream`` loads (the monitor's diagnosis suggests changes to these)."""
        from gpuwise.monitor.verdict import Loader

        return Loader(num_workers=self.workers, pin_memory=pin, prefetch_factor=2 if self.workers else None,
                      persistent_workers=False if self.workers else None)

    def stream(self, start: int, steps: int, batch: int, rank: int, world_size: int, pin: bool) -> Iterator:
        sampler = StepSampler(self.length, batch, seed=self.seed, start=start, steps=steps, rank=rank,
                              world_size=world_size)
        # its own generator: the workers' base seed must not come from (and advance) the global RNG, which the
        # checkpoint saves and a resumed run restores
        loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.workers,
                                             pin_memory=pin, persistent_workers=False, worker_init_fn=_warm_worker,
                                             generator=torch.Generator().manual_seed(self.seed + start))
        batches = iter(loader)
        try:
            for collated in batches:
                yield _split_item(collated)
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit):  # not a run that simply stopped reading
                _stop_workers(batches)
            raise


def _stop_workers(batches: Any) -> None:
    """End a DataLoader's worker processes now: after a --data-timeout (or a second Ctrl-C) a worker stuck in
    ``__getitem__`` heeds no shutdown message, and the DataLoader waits 5 s on each before it kills it."""
    for worker in getattr(batches, "_workers", ()):  # the multiprocessing iterator's (torch keeps the name)
        with contextlib.suppress(Exception):
            worker.terminate()


def dataset_length(dataset: Any) -> int:
    """``len(dataset)``, checked: a ``__len__`` that raises, or returns a negative number, a float or anything but a
    whole number, is the user's to fix in one line (``len()`` itself raised ValueError or TypeError: exit 3)."""
    name = type(dataset).__name__
    hint = "make __len__ return the number of items, a whole number >= 1 (e.g. return len(self.items))"
    try:
        raw = type(dataset).__len__(dataset)
    except SystemExit as exc:
        raise GpuwiseError(f"{name}.__len__() called sys.exit({exc.code})", hint) from None
    except Exception as exc:
        raise GpuwiseError(f"{name}.__len__() raised {first_line(exc)}", hint) from exc
    try:
        length = operator.index(raw)  # an int, a NumPy integer or a 0-d integer tensor; never a float
    except TypeError:
        length = None
    if length is None or isinstance(raw, bool) or length < 0:
        shown = repr(raw) if isinstance(raw, (int, float, str, type(None))) else type(raw).__name__
        raise GpuwiseError(f"{name}.__len__() returned {shown[:40]}, not a number of items", hint)
    return length


def _warm_worker(worker_id: int) -> None:
    warm_cpu_vml()  # a spawned worker is a fresh process: its first sizable sqrt/exp/... must not race


def rows(x: Any, sl: slice) -> Any:
    """Rows ``sl`` of a tensor, or of each tensor in a tuple (the batch is dimension 0)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x[sl]
    if isinstance(x, Mapping):
        return {k: rows(v, sl) for k, v in x.items()}
    return tuple(rows(t, sl) for t in x)


def to_device(x: Any, device: torch.device) -> Any:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)  # overlaps the copy with compute when the source is pinned
    if isinstance(x, Mapping):
        return {k: to_device(v, device) for k, v in x.items()}
    return tuple(to_device(t, device) for t in x)


def pinned(x: Any) -> Any:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.pin_memory()
    if isinstance(x, Mapping):
        return {k: pinned(v) for k, v in x.items()}
    return tuple(pinned(t) for t in x)


def batch_rows(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.shape[0]
    return batch_rows(next(iter(x.values())) if isinstance(x, Mapping) else x[0])


def stream(data: Any, start: int, steps: int, batch: int, rank: int = 0, world_size: int = 1,
           pin: bool = False) -> Iterator[tuple[Any, Any]]:
    """This process's share of each step's global batch, from step ``start`` to ``steps``."""
    if hasattr(data, "stream"):
        yield from data.stream(start, steps, batch, rank, world_size, pin)
        return
    share = batch // world_size
    for step in range(start, steps):
        x, y = data.batch(step, batch)
        sl = slice(rank * share, (rank + 1) * share)
        x, y = rows(x, sl), rows(y, sl)
        yield (pinned(x), pinned(y)) if pin else (x, y)



def as_batches(data: Any, seed: int) -> Any:
    """What the Trainer reads: numbered batches as they are; a map-style Dataset through the step sampler; a
    DataLoader refused (its order cannot be resumed)."""
    if hasattr(data, "batch") or hasattr(data, "stream"):
        return data
    if isinstance(data, torch.utils.data.DataLoader):
        raise GpuwiseError("the Trainer takes the Dataset, not a DataLoader",
                           "pass loader.dataset: the Trainer numbers the batches so a resume reads the same ones")
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return DatasetBatches(data, seed=seed)
    raise GpuwiseError(f"the Trainer cannot read batches from {type(data).__name__}",
                       "pass a map-style Dataset of (input, target) items, or an object with batch(number, size)")


def small_dataset_note(data: Any, batch: int) -> str | None:
    """Said when a Dataset holds fewer items than the batch: every step then reads its items more than once
    (a one-item Dataset was read 8 times a step at --batch 8, silently)."""
    if not isinstance(data, DatasetBatches):
        return None
    n = data.length
    if n == 0 or n >= batch:
        return None
    items = "1 item" if n == 1 else f"{n} items"
    return (f"the dataset holds {items}, fewer than the batch of {batch}: each step reads every item about "
            f"{batch / n:.3g} times (lower --batch, or give more data)")
