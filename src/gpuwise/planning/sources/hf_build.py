"""Building a model whose constructor reads tensor values, under fake tensors or on the meta device.

ConvNeXt, Swin, CvT, FocalNet and most vision models compute their drop-path rates as
``[x.item() for x in torch.linspace(0, rate, depth)]``; fake and meta tensors have no values to read. Under
``concrete_constants()`` the few factory calls that make such constants (``linspace``, ``arange``, ``tensor``...,
and tensors made from Python or NumPy data, with at most ``SMALL_NUMEL`` elements) give real CPU tensors, and
what is computed from real tensors alone stays real, so Python can read the values. Parameters and buffers
must not stay real (the plan counts their bytes on the device): when the constructor returns, every parameter or
buffer that is a real tensor is swapped for an empty one of the same shape, dtype and stride made where the model
lives (a fake tensor, or a meta one), its ``requires_grad`` and any sharing between modules kept.

A constructor may also convert a submodule (DeepSeek-V4's and HY-V4's ``RMSNorm(...).to(dtype=torch.float32)``,
Inkling's ``Conv1d``). ``nn.Module._apply`` swaps fake parameters in place with ``torch.utils.swap_tensors``, which
refuses a tensor that anything holds a weak reference to (the plan's trackers do): there, while the model is
built, the converted tensors replace the old ones in their modules' tables instead, as ``_apply`` does for
ordinary tensors under ``torch.__future__.set_overwrite_module_params_on_conversion(True)``.

    with concrete_constants() as fix:
        model = cls(config)
    fix(model)

Switch Transformer's sparse MLP converts its router inside forward and reads its routing choice back (which experts
were hit, each one's name formatted from a tensor): ``top1_routers`` runs it as the GPU does (see there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gpuwise.compat import FakeTensor, TorchDispatchMode, tree_leaves, unset_fake_temporarily

# Factory calls that make constants from Python numbers: drop-path rates, position indices, scales
_FACTORIES = frozenset({torch.linspace, torch.logspace, torch.arange, torch.tensor, torch.as_tensor})
SMALL_NUMEL = 1 << 16  # a constant, not a weight: 64 Ki elements at most (drop-path rates have one a block)


def _unreal(t: torch.Tensor) -> bool:
    """Whether ``t`` has no values to read: a fake or a meta tensor."""
    return isinstance(t, FakeTensor) or t.is_meta


class _Constants(TorchFunctionMode):
    """Small factory outputs made for real on the CPU, and what is computed from real tensors alone (``.split``,
    ``.tolist()``) computed for real too, outside any fake mode; everything else as the modes below make it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(_unreal(t) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if tensors or func not in _FACTORIES or not isinstance(out, torch.Tensor) or not _unreal(out) \
                or out.numel() > SMALL_NUMEL:
            return out
        with unset_fake_temporarily():
            return func(*args, **{**kwargs, "device": "cpu"})  # under any device context


class _Literals(TorchDispatchMode):
    """Below the Python API, above the fake mode: a tensor made from Python or NumPy data (``aten.lift_fresh``, which
    ``torch.Tensor(np.linspace(...))`` calls, BiT's drop-path rates) stays real where it is small, and an op on real
    tensors alone (its ``.to(float32)``) runs for real."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func is torch.ops.aten.lift_fresh.default and not _unreal(args[0]) and args[0].numel() <= SMALL_NUMEL:
            return args[0]
        if tensors and not any(_unreal(t) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _unrealize(model: nn.Module) -> None:
    """Every parameter and buffer of ``model`` that is a real tensor becomes an empty one made as the model's own
    (``torch.empty_strided`` under the ambient fake mode and device), shared ones shared still."""
    done: dict[int, torch.Tensor] = {}

    def swap(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            # where the ambient modes put a new tensor (the fake mode's CPU, or meta), in t's dtype and layout
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
            done[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return done[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if isinstance(t, torch.Tensor) and not _unreal(t):
                    table[name] = swap(t)


def _overwriting_apply(original: Callable) -> Callable:
    """``nn.Module._apply`` that, where swapping a fake tensor fails, puts the converted one in its place."""
    def _apply(self: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
        try:
            return original(self, fn, recurse)
        except RuntimeError as exc:
            if "Couldn't swap" not in str(exc):
                raise
        done: dict[int, torch.Tensor] = {}
        for module in self.modules() if recurse else (self,):
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if not isinstance(t, torch.Tensor):
                        continue
                    if id(t) not in done:
                        with torch.no_grad():
                            new = fn(t)
                        if isinstance(t, nn.Parameter) and new is not t:
                            new = nn.Parameter(new, requires_grad=t.requires_grad)
                        done[id(t)] = new
                    table[name] = done[id(t)]
        return self

    return _apply


@contextlib.contextmanager
def concrete_constants() -> Iterator[Callable[[nn.Module], None]]:
    """Small constants made for real while a model is built under fake tensors or on the meta device; yields the
    function that makes the built model's parameters and buffers unreal again. Where new tensors are real anyway
    (a real run), it does nothing."""
    if not _unreal(torch.empty(0)):
        yield lambda model: None
        return
    with fake_conversions(), _Constants(), _Literals():
        yield _unrealize


@contextlib.contextmanager
def fake_conversions() -> Iterator[None]:
    """``module.to(dtype)`` on fake parameters converts them in place (``_overwriting_apply``) instead of failing
    where ``swap_tensors`` refuses them, which it does or not depending on the fake mode's caches."""
    original = nn.Module._apply
    nn.Module._apply = _overwriting_apply(original)
    try:
        yield
    finally:
        nn.Module._apply = original



class _Top1Routing(TorchFunctionMode):
    """Inside a Switch Transformer sparse MLP: ``argmax`` as the first index of ``topk(1)`` (the same expert, ties
    aside), whose fake output the planner's balanced routing stand-in answers (capture/routing.py); and a 0-d tensor
    formatted as its value, as a real one formats (``f"expert_{expert_idx[0]}"``: a fake tensor would format as its
    repr), which reads it (``.item()``) from that stand-in."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.argmax, torch.Tensor.argmax) and args and isinstance(args[0], torch.Tensor):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim is not None and not kwargs.get("keepdim", False):
                return torch.topk(args[0], 1, dim=dim).indices.squeeze(dim)
        if func is torch.Tensor.__format__ and args[0].dim() == 0:
            return format(args[0].item(), *args[1:])
        return func(*args, **kwargs)


def top1_routers(model: nn.Module) -> None:
    """Switch Transformer's sparse MLPs (transformers' ``SwitchTransformersSparseMLP``: a top-1 router, then a loop
    over the experts hit) as they run on the GPU.

    The router's forward converts its classifier to the router's dtype (``self.classifier.to(self.dtype)``: fp32, the
    paper's selective precision, sec. 2.4), which on a GPU converts it once and leaves it so: here it is converted
    when the model is built (the step's steady state), and the forward's own ``.to`` converts nothing
    (``fake_conversions``). Its choice of expert and the loop's reads run under ``_Top1Routing``."""
    for module in model.modules():
        router = getattr(module, "router", None)
        classifier, dtype = getattr(router, "classifier", None), getattr(router, "dtype", None)
        if not (type(router).__name__.endswith("Top1Router") and isinstance(classifier, nn.Linear)
                and isinstance(dtype, torch.dtype)):
            continue
        with fake_conversions():
            router.classifier = classifier.to(dtype)

        def forward(*args, _inner=module.forward, **kwargs):
            with fake_conversions(), _Top1Routing():
                return _inner(*args, **kwargs)

        module.forward = forward
