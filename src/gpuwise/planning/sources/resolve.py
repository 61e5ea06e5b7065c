"""Which source the command line names: ``--model NAME``, ``--model file.py:function`` or ``--hf-config PATH``."""

from __future__ import annotations

from pathlib import Path

from gpuwise.errors import GpuwiseError
from gpuwise.files import file_function
from gpuwise.models import get_model
from gpuwise.planning.sources.file import FileSource
from gpuwise.planning.sources.hf import HFSource
from gpuwise.planning.sources.zoo import ZooSource


def resolve_source(model: str | None, hf_config: str | None) -> ZooSource | FileSource | HFSource:
    """``--model NAME`` or ``--model file.py:function``, or ``--hf-config PATH``."""
    if model and hf_config:
        raise GpuwiseError("--model and --hf-config both name a model", "pass one of them")
    if hf_config:
        return HFSource.from_path(Path(hf_config))
    if not model:
        raise GpuwiseError("no model to plan", "pass --model NAME (see --list-models) or --model file.py:function")
    if model.endswith(".py") or ".py:" in model:
        path, fn = file_function(model, "--model")
        return FileSource(path=path, function=fn)
    return ZooSource(zoo=get_model(model))
