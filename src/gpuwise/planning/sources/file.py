"""A user's Python file as a source: ``--model path/to/file.py:function``, where ``function(batch_size)`` returns
``(model, inputs)``."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.planning.setup import Setup
from gpuwise.planning.sources.base import Built, scalar_loss
from gpuwise.planning.sources.hf_build import fake_conversions


@functools.lru_cache(maxsize=8)
def _import_file(path: str, mtime_ns: int) -> ModuleType:
    """Import a user's file once (per modification), registered in sys.modules as dataclasses need."""
    name = f"gpuwise_user_{abs(hash((path, mtime_ns)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise GpuwiseError(f"{path} is not a Python file", "pass --model path/to/file.py:function")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(Path(path).parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's module: report its error in one line
        del sys.modules[name]
        raise GpuwiseError(f"importing {path} raised {first_line(exc)}",
                           "fix the file, or run it with python to see the traceback") from exc
    finally:
        sys.path.remove(folder)
    return module


@dataclass(frozen=True, kw_only=True)
class FileSource:
    """``path/to/file.py:function`` where ``function(batch_size)`` returns ``(model, inputs)``."""

    path: Path
    function: str
    decoder = None  # a function's model is a black box: no KV-cache dimensions
    max_positions = None

    @property
    def name(self) -> str:
        return f"{self.path.name}:{self.function}"

    n_layer = None
    layer_kinds = None

    def check(self, setup: Setup) -> None:
        if setup.audio_seconds is not None:
            raise GpuwiseError("--audio-seconds applies to speech models of an --hf-config; your function makes the "
                               "inputs of a model from a file", "drop --audio-seconds")
        if setup.task == "decode":
            raise GpuwiseError("--task decode feeds a KV cache the planner fills: a built-in decoder or a --hf-config "
                               "causal LM, not a model from a file", "plan --task infer (your function sizes the "
                               "inputs), or use --model llama3-8b / --hf-config config.json")
        if setup.attention not in (None, "sdpa"):
            raise GpuwiseError("--attention applies to the built-in GPT and Llama models",
                               "call gpuwise.ops.attention in your model instead")
        if setup.loss != "standard":
            raise GpuwiseError(f"--loss {setup.loss} applies to the built-in decoders and --hf-config causal LMs",
                               "compute the loss you run in your model, or drop --loss")
        if setup.seq is not None or setup.image_size is not None:
            raise GpuwiseError("--seq and --image-size do not apply to a model from a file",
                               "size the inputs in your function; it receives batch_size only")

    def tokens(self, setup: Setup) -> int:
        return 1

    def load(self) -> Callable[[int], Any]:
        if not self.path.is_file():
            raise GpuwiseError(f"no such file: {self.path}", "pass --model path/to/file.py:function")
        module = _import_file(str(self.path.resolve()), self.path.stat().st_mtime_ns)
        fn = getattr(module, self.function, None)
        if not callable(fn):
            found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                           and getattr(v, "__module__", None) == module.__name__)
            raise GpuwiseError(f"{self.path} has no function {self.function!r}",
                               f"functions there: {', '.join(found) or 'none'}")
        return fn

    def build(self, setup: Setup, batch: int, n_layer: int | None) -> Built:
        return build_function(self.name, self.load(), setup, batch)


def call_model_function(name: str, fn: Callable[[int], Any], batch: int, *, fake: bool = True
                        ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``fn(batch)``, checked to return ``(model, inputs)``; its errors become one line. A model the function
    converts (``.to(torch.bfloat16)``) is planned as converted, as it would run."""
    try:
        with fake_conversions() if fake else contextlib.nullcontext():
            result = fn(batch)
    except GpuwiseError:
        raise
    except Exception as exc:
        text = first_line(exc)
        if "UninitializedParameter" in text or "UninitializedBuffer" in text:  # a lazy module made on fake tensors
            raise _lazy(name, batch, None) from exc
        if fake and ("Couldn't swap" in text or "not linked with support for cuda" in text.lower()):
            raise GpuwiseError(f"{name}({batch}) moves or converts the model ({text})",
                               "build it on the CPU in its default dtype, with no .to()/.cuda()/.half(): "
                               "--precision chooses the dtype and the plan is for the GPU") from exc
        raise GpuwiseError(f"{name}({batch}) raised {text}",
                           "fix the function; it runs on fake tensors, so it must not read tensor values" if fake
                           else "fix the function; run the file with python to see the traceback") from exc
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise GpuwiseError(f"{name}({batch}) must return (model, inputs)",
                           "return an nn.Module and a tensor or a tuple of tensors")
    model, inputs = result
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise GpuwiseError(f"{name}({batch}) returned inputs that are not tensors",
                           "return a tensor or a tuple of tensors as inputs")
    check_model(name, batch, model)
    return model, inputs


def check_model(name: str, batch: int, model: nn.Module) -> None:
    """Refuse, in one line, a model that cannot run a step: a lazy module's uninitialized parameters
    (``nn.LazyLinear``), or tensors on the meta device (no values). Both were internal errors deep in
    the trainer (exit 3), or a misleading "report it" in the plan."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    lazy = next((n for n, t in tensors if nn.parameter.is_lazy(t)), None)
    if lazy is not None:
        raise _lazy(name, batch, lazy)
    meta = next((n for n, t in tensors if t.device.type == "meta"), None)
    if meta is not None:
        raise GpuwiseError(f"{name}({batch}) returns a model on the meta device ({meta} has a shape but no values)",
                           "build it on the CPU (no torch.device('meta')), or call model.to_empty(device='cpu') "
                           "and initialise the weights before returning it")


def _lazy(name: str, batch: int, tensor: str | None) -> GpuwiseError:
    where = f" ({tensor})" if tensor else ""
    return GpuwiseError(f"{name}({batch}) returns a model with uninitialized parameters{where}: a lazy module "
                        "(nn.LazyLinear, nn.LazyConv2d...) learns its sizes only from a first forward",
                        "give the layer its input size (nn.Linear(in_features, out_features)), or run one forward "
                        "on the inputs in the function before returning the model")


def detached_loss(loss_of: str, whose: str) -> GpuwiseError:
    """A loss without a gradient, in plan (here) and train (the Trainer): backward would fail in PyTorch's words
    ("element 0 of tensors does not require grad", exit 3); the model's output was cut from its weights, not by a
    fake-tensor rule. ``loss_of``: the step or model ("step 3"); ``whose``: whose output ("Net's")."""
    return GpuwiseError(f"the loss of {loss_of} has no gradient: {whose} output is detached from its weights "
                        "(a .detach(), torch.no_grad() or .item() in forward, or a tensor rebuilt from values)",
                        "return the output of the layers themselves from forward, with no .detach() on the way")


def _trainable_loss(name: str, loss: torch.Tensor) -> torch.Tensor:
    """A training step's loss that backward can follow (else ``detached_loss``)."""
    if not loss.requires_grad:
        raise detached_loss(name, "the model's")
    return loss


def build_function(name: str, fn: Callable[[int], Any], setup: Setup, batch: int) -> Built:
    """The step of a model built by ``fn(batch) -> (model, inputs)``; the loss is the output if it is a
    scalar, else the mean square of the output."""
    model, inputs = call_model_function(name, fn, batch)

    def run(model, inputs, targets, kv_cache):
        out = model(*inputs)
        return _trainable_loss(name, scalar_loss(out)) if setup.training else out

    return Built(model=model, inputs=inputs, targets=None, run=run)
