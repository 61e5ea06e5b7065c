"""Every private PyTorch API gpuwise uses, in one place, with the torch versions each was checked on.

Private names move between releases; when one does, this file is the only one to change. Workarounds for bugs in
the libraries torch bundles live here too. Each entry was checked on torch 2.5, 2.11 (the H200 machine) and 2.13
(CI) unless its comment says otherwise.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import threading
import types

# Fake tensors: tensors with shapes and dtypes but no storage, so a whole step runs without memory.
# torch._subclasses.fake_tensor since 2.0; DataDependentOutputException is raised by .item() and friends.
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,  # real tensors inside a fake mode (hf_build: constants a constructor reads)
)

try:  # an op whose output shape depends on values (nonzero, unique): in every torch gpuwise supports
    from torch._subclasses.fake_tensor import DynamicOutputShapeException
except ImportError:  # pragma: no cover
    DynamicOutputShapeException = DataDependentOutputException

# Where FakeTensorMode logs a failing op's traceback before re-raising it (the planner reports one line).
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"

# A mode that sees every aten op with its tensors (the planner's memory tracker). Public since 2.x in spirit,
# private in name: torch.utils._python_dispatch. _disable_current_modes runs real tensor code inside a mode (the
# MoE routing stand-in computes its concrete twins with it).
# _get_current_dispatch_mode_stack: the modes active now (quantised MoE experts tell the planner's tracker which of
# their tensors are stand-ins).
from torch.utils._python_dispatch import (  # noqa: E402
    TorchDispatchMode,
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)

# Flatten nested outputs of an op to their tensors. torch.utils._pytree (the public torch.utils.pytree
# appears in 2.6 and is not in 2.5).
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten  # noqa: E402


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


__all__ = ["FAKE_TENSOR_LOGGER", "DataDependentOutputException", "DynamicOutputShapeException", "FakeTensor",
           "FakeTensorMode", "TorchDispatchMode", "_disable_current_modes", "_get_current_dispatch_mode_stack",
           "fake_tensor_mode", "fsdp2", "light_dynamo", "scaled_mm", "tree_flatten", "tree_leaves", "tree_map",
           "tree_unflatten", "unset_fake_temporarily"]


# The float unary ops ATen sends to oneMKL's VML on the CPU (aten/src/ATen/cpu/vml.h, IMPLEMENT_VML_MKL).
VML_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin", "sqrt",
           "tan", "tanh", "trunc")


@functools.cache
def warm_cpu_vml() -> None:
    """Call each VML-backed op once, on one element, on this thread, before any of them runs on several threads.

    oneMKL 2024.2 (the one the torch wheels bundle, 2.10 to 2.13 at least) picks a VML function's kernel on its
    first call. When that first call runs on several intra-op threads at once, which a busy machine makes
    likely, one thread can run a low-accuracy kernel on its whole chunk (pytorch/pytorch#188792: errors to
    ~4000 ulp; fixed in oneMKL 2025). Here it was AdamW's first ``sqrt`` of the second moments: 24,573 of the
    49,152 values of a 384x128 tensor (one thread's half) differed from an identical second call, in 3 of 20
    runs of ``gpuwise train`` under load, so two identical runs (or a resumed one) drifted apart. A one-element
    call runs on the calling thread alone and settles the choice for the whole process (a forked child
    inherits it). Harmless without MKL, and a no-op after the first call."""

    import torch

    if not torch.backends.mkl.is_available():
        return
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for name in VML_OPS:
            getattr(torch, name)(x)


# A capture without importing TorchDynamo. Fake tensors never compile, yet torch reaches for ``torch._dynamo`` from
# them: ``FakeTensorMode()`` reads ``torch._dynamo.config``, its dispatch is wrapped in ``torch._disable_dynamo``
# (torch/_compile.py: ``torch._dynamo.disable`` on each wrapped function's first call), fake tensors made from real
# constants import ``torch._dynamo.source``, and the optimizers call ``torch._dynamo.graph_break()``. Importing the
# package costs a cold ``gpuwise plan`` about 1.2 s of CPU (convert_frame, symbolic_convert, the variable trackers,
# trace rules), and its ``disable`` wrapper then runs around every fake op: 18 captures of recommend llama2-7b went
# from 8.5 to 6.6 s of CPU without it.
#
# So, where nothing imported ``torch._dynamo`` yet, ``light_dynamo()`` puts a stand-in module in its place holding the
# package's own ``config`` and ``source`` submodules, ``disable`` as a wrapper that calls the function as it is until
# TorchDynamo is loaded (outside a compilation there is nothing to disable) and the real ``disable`` from then on, and
# ``graph_break`` as the no-op it is outside a compilation. Asking it for anything else, or importing any other of its
# submodules (``torch.compile``, ``torch._dynamo.reset()``, ``--compile``), first runs the package's ``__init__`` into
# the same module object, which is the real package from then on; the functions torch had cached the stand-in's
# ``disable`` for get the real one on their next call. A torch whose ``config`` or ``source`` needs more than the
# stand-in has gets the real package at once. Checked on torch 2.13 (tests/test_compat_dynamo.py); older releases, not
# checked, import the real package as before. ``GPUWISE_LIGHT_DYNAMO=0`` turns it off.
_DYNAMO = "torch._dynamo"
_DYNAMO_LIGHT = ("config", "source")  # the submodules fake tensors import
_DYNAMO_CHECKED = (2, 13)  # the first release the stand-in was checked on
_dynamo_lock = threading.RLock()
_dynamo_loading = False  # light_dynamo() is importing _DYNAMO_LIGHT under the stand-in


class _LightDynamo(types.ModuleType):
    """The stand-in (above): a module whose misses load the real package into it."""

    real = False
    wrapped: list  # the functions torch cached our ``disable`` on (torch/_compile.py's ``fn.__dynamo_disable``)

    def __getattr__(self, name: str):
        if self.real or (name.startswith("__") and name != "__all__") or _dynamo_loading:  # the import system then
            raise AttributeError(f"module {_DYNAMO!r} has no attribute {name!r}")  # imports the submodule
        _become_real(self)
        try:
            return self.__dict__[name]
        except KeyError:
            raise AttributeError(f"module {_DYNAMO!r} has no attribute {name!r}") from None


class _DynamoFinder(importlib.abc.MetaPathFinder):
    """Before any submodule the stand-in lacks is imported, the stand-in becomes the real package."""

    def find_spec(self, fullname, path=None, target=None):
        module = sys.modules.get(_DYNAMO)
        if not _dynamo_loading and fullname.startswith(_DYNAMO + ".") and isinstance(module, _LightDynamo) \
                and not module.real:
            _become_real(module)
        return None


_DYNAMO_FINDER = _DynamoFinder()


def _become_real(module: _LightDynamo) -> None:
    """Run the package's ``__init__`` into the stand-in: its own names replace ``disable`` and ``graph_break``."""
    with _dynamo_lock:
        if module.real:
            return
        module.real = True
        if _DYNAMO_FINDER in sys.meta_path:
            sys.meta_path.remove(_DYNAMO_FINDER)
        stand_in = module.__dict__.pop("disable", None)
        module.__dict__.pop("graph_break", None)
        module.__spec__.loader.exec_module(module)
        for fn in module.wrapped:  # torch/_compile.py asks for the real disable on the next call
            if getattr(getattr(fn, "__dynamo_disable", None), "stand_in", None) is stand_in:
                del fn.__dynamo_disable


def _light_disable(module: _LightDynamo):
    def disable(fn=None, recursive=True, **kwargs):
        """``torch._dynamo.disable``: ``fn`` as it is while TorchDynamo is not loaded, the real wrapper once it is."""
        if fn is None:
            return lambda f: disable(f, recursive, **kwargs)
        real = None

        def run(*args, **kw):
            nonlocal real
            if not module.real:
                return fn(*args, **kw)
            if real is None:
                real = module.disable(fn, recursive, **kwargs)
            return real(*args, **kw)

        run.__wrapped__, run.stand_in = fn, disable
        run.__name__ = getattr(fn, "__name__", "disabled")
        with _dynamo_lock:
            module.wrapped.append(fn)
        return run

    return disable


def _light_graph_break(module: _LightDynamo):
    def graph_break(*args, **kwargs) -> None:
        """A no-op outside a compilation, which needs TorchDynamo loaded: then the real one."""
        if module.real:
            module.graph_break(*args, **kwargs)

    return graph_break


def light_dynamo() -> None:
    """Put the stand-in in place of ``torch._dynamo`` if nothing imported it yet (the comment above)."""
    global _dynamo_loading
    if os.environ.get("GPUWISE_LIGHT_DYNAMO", "1") == "0":
        return
    with _dynamo_lock:
        if _DYNAMO in sys.modules:
            return
        import torch

        try:
            release = tuple(int(x) for x in torch.__version__.split(".")[:2])
        except ValueError:
            return
        if release < _DYNAMO_CHECKED:
            return
        spec = importlib.util.find_spec(_DYNAMO)
        if spec is None or spec.submodule_search_locations is None or spec.loader is None:
            return
        module = _LightDynamo(_DYNAMO)
        module.__spec__, module.__loader__, module.__file__ = spec, spec.loader, spec.origin
        module.__path__, module.__package__ = list(spec.submodule_search_locations), _DYNAMO
        module.wrapped = []
        module.disable, module.graph_break = _light_disable(module), _light_graph_break(module)
        sys.modules[_DYNAMO] = module
        torch._dynamo = module
        sys.meta_path.insert(0, _DYNAMO_FINDER)
        _dynamo_loading = True
        try:
            for name in _DYNAMO_LIGHT:
                importlib.import_module(f"{_DYNAMO}.{name}")
        except Exception:  # another torch's layout: the real package, imported now
            _dynamo_loading = False
            _become_real(module)
        finally:
            _dynamo_loading = False


def fake_tensor_mode(**kwargs) -> FakeTensorMode:
    """A ``FakeTensorMode``, without importing TorchDynamo where it can (``light_dynamo``): every capture's."""
    light_dynamo()
    return FakeTensorMode(**kwargs)
