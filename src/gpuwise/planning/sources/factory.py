"""A model factory from the Python API as a source: ``plan_model(lambda: MyNet(), setup)``.

``factory()`` returns the ``nn.Module``, built like any source inside the fake mode (nothing allocated), its inputs
made for its first layer: token ids for an ``nn.Embedding`` (``Setup.seq`` of them), ``(B, in_features)`` for an
``nn.Linear``, ``(B, C, S, S)`` images for an ``nn.Conv2d`` (``Setup.image_size``, else 224). A factory that takes
the batch size and returns ``(model, inputs)`` is called as ``--model file.py:function`` calls its function. A factory
has no identity that outlives the process, so its captures are never kept on disk (capture/cache.py).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.base import Built
from gpuwise.planning.sources.file import build_function

DEFAULT_IMAGE = 224  # the ImageNet crop the torchvision classifiers are trained at


def takes_batch(factory: Callable[..., Any]) -> bool:
    """Whether ``factory`` takes the batch size (a required positional parameter): the file function's contract."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called bare
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


@dataclass(frozen=True, kw_only=True)
class _Entry:
    """What the model's first layer takes: ``tokens`` (vocabulary), ``features`` (width) or ``images`` (channels)."""

    kind: str
    size: int
    model_class: str


@dataclass(frozen=True, kw_only=True)
class FactorySource:
    """``factory()`` -> ``nn.Module`` (its inputs made for its first layer), or ``factory(batch_size)`` ->
    ``(model, inputs)``."""

    factory: Callable[..., Any]
    decoder = None  # a factory's model is a black box: no KV-cache dimensions
    max_positions = None
    n_layer = None
    layer_kinds = None

    @property
    def name(self) -> str:
        qualname = getattr(self.factory, "__qualname__", None) or type(self.factory).__name__
        if "<lambda>" not in qualname or takes_batch(self.factory):
            return qualname
        return f"{self._entry.model_class} (factory)"

    @functools.cached_property
    def _entry(self) -> _Entry:
        """The first layer of the model, built once on the meta device (nothing allocated)."""
        try:
            with torch.device("meta"):
                model = self.factory()
        except GpuwiseError:
            raise
        except Exception as exc:  # the user's factory: its error in one line
            raise GpuwiseError(f"the model factory raised {first_line(exc)}",
                               "fix the factory; it runs on fake tensors, so it must not read tensor values") from exc
        if not isinstance(model, nn.Module):
            raise GpuwiseError(f"the model factory returned {type(model).__name__}, not an nn.Module",
                               "return the model (or take batch_size and return (model, inputs))")
        first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
        cls = type(model).__name__
        if isinstance(first, nn.Embedding):
            return _Entry(kind="tokens", size=first.num_embeddings, model_class=cls)
        if isinstance(first, nn.Linear):
            return _Entry(kind="features", size=first.in_features, model_class=cls)
        if isinstance(first, nn.Conv2d):
            return _Entry(kind="images", size=first.in_channels, model_class=cls)
        what = type(first).__name__ if first is not None else "no layer with parameters"
        raise GpuwiseError(f"cannot tell the inputs of {cls}: its first layer is {what}, not an nn.Embedding, "
                           "nn.Linear or nn.Conv2d", "make the factory take batch_size and return (model, inputs)")

    def check(self, setup: Setup) -> None:
        for given, flag, applies in ((setup.audio_seconds is not None, "--audio-seconds", False),
                                     (setup.attention not in (None, "sdpa"), "--attention", False),
                                     (setup.loss != "standard", "--loss", False),
                                     (setup.task == "decode", "--task decode", False),
                                     (setup.seq is not None, "--seq", "tokens"),
                                     (setup.image_size is not None, "--image-size", "images")):
            if given and (takes_batch(self.factory) or applies != self._entry.kind):
                raise GpuwiseError(f"{flag} does not apply to {self.name}, a model factory"
                                   + ("" if applies is False else f" whose first layer does not take {applies}"),
                                   f"drop {flag}" + ("; the factory sizes the inputs" if takes_batch(self.factory)
                                                     else ""))
        if not takes_batch(self.factory) and self._entry.kind == "tokens" and setup.seq is None:
            raise GpuwiseError(f"{self.name} takes token ids (its first layer is an nn.Embedding) and the setup gives "
                               "no sequence length", "pass Setup(seq=N) (--seq N)")

    def tokens(self, setup: Setup) -> int:
        """Tokens per micro-batch element: ``seq`` for a token model, else one sample."""
        return setup.seq or 1 if not takes_batch(self.factory) and self._entry.kind == "tokens" else 1

    def build(self, setup: Setup, batch: int, n_layer: int | None) -> Built:
        if takes_batch(self.factory):
            return build_function(self.name, self.factory, setup, batch)
        entry = self._entry

        def with_inputs(b: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
            model = self.factory()
            if entry.kind == "tokens":
                return model, (torch.zeros(b, setup.seq or 1, dtype=torch.long),)
            if entry.kind == "features":
                return model, (torch.randn(b, entry.size, dtype=setup.input_dtype),)
            side = setup.image_size or DEFAULT_IMAGE
            return model, (torch.randn(b, entry.size, side, side, dtype=setup.input_dtype),)

        return build_function(self.name, with_inputs, setup, batch)
