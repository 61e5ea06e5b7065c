"""Which source the command line (or the Python API) names: ``--model NAME``, ``--model file.py:function``, a model
factory, or ``--hf-config`` (a config.json, a checkpoint folder, a ``.gguf`` file, or a Hub id ``owner/name``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from gpuwise.errors import GpuwiseError
from gpuwise.files import file_function
from gpuwise.models import get_model
from gpuwise.planning.sources.factory import FactorySource
from gpuwise.planning.sources.file import FileSource
from gpuwise.planning.sources.hf import HFSource
from gpuwise.planning.sources.hub import hub_file, is_hub_id
from gpuwise.planning.sources.zoo import ZooSource

Model = str | Callable[..., Any]  # a name, file.py:function, or a factory (factory.py)


def resolve_source(model: Model | None, hf_config: str | None) -> ZooSource | FileSource | FactorySource | HFSource:
    """``--model NAME``, ``--model file.py:function`` or a model factory, or ``--hf-config PATH_OR_HUB_ID``.

    >>> resolve_source(lambda: __import__("torch").nn.Linear(4, 4), None).name
    'Linear (factory)'
    """
    if model and hf_config:
        raise GpuwiseError("--model and --hf-config both name a model", "pass one of them")
    if hf_config:
        if is_hub_id(hf_config):
            return HFSource.from_path(hub_file(hf_config), label=hf_config)
        return HFSource.from_path(Path(hf_config))
    if isinstance(model, nn.Module):
        raise GpuwiseError(f"a built {type(model).__name__} holds real tensors; the plan builds the model on fake ones",
                           f"pass a factory: lambda: {type(model).__name__}(...)")
    if callable(model):
        return FactorySource(factory=model)
    if not model:
        raise GpuwiseError("no model to plan", "pass --model NAME (see --list-models) or --model file.py:function")
    if model.endswith(".py") or ".py:" in model:
        path, fn = file_function(model, "--model")
        return FileSource(path=path, function=fn)
    return ZooSource(zoo=get_model(model))


def as_source(model: Any):
    """A source as it is (anything with ``build``), else ``resolve_source(model, None)``: a name or a factory."""
    return model if hasattr(model, "build") and hasattr(model, "check") else resolve_source(model, None)
