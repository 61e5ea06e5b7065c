"""The optimizers a plan steps, each allocating its state as its library stores it, on fake tensors too.

| ``--optimizer``   | stands for                          | state per parameter                                    |
| ----------------- | ----------------------------------- | ------------------------------------------------------ |
| adamw             | torch.optim.AdamW (foreach)         | exp_avg, exp_avg_sq in the parameter's dtype           |
| sgd               | torch.optim.SGD, momentum 0.9       | momentum_buffer in the parameter's dtype               |
| adamw8bit         | bitsandbytes.optim.AdamW8bit        | two uint8 states + two fp32 absmax per 256 elements;   |
|                   |                                     | under 4096 elements two fp32 states                    |
| paged-adamw8bit   | bitsandbytes.optim.PagedAdamW8bit   | the same; states of >= 1e5 elements in paged memory    |
| adafactor         | torch.optim.Adafactor (foreach)     | >= 2-D: row (..., R, 1) and column (..., 1, C) second  |
|                   |                                     | moments; 1-D: a full one; no first moment              |
| lion              | lion-pytorch (lucidrains)           | exp_avg in the parameter's dtype                       |

torch's own optimizers run as they are. bitsandbytes has no CPU or fake-tensor path (its kernels are CUDA), and
lion-pytorch is not a dependency, so ``AdamW8bit`` and ``Lion`` below allocate what those libraries allocate
and move the bytes their kernels move; their arithmetic is not theirs (a plan reads no values).

>>> make_optimizer("adamw8bit", [{"params": [torch.nn.Parameter(torch.zeros(4096, 4))]}]).__class__.__name__
'AdamW8bit'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, get_args

import torch

from gpuwise.compat import FakeTensor, TorchDispatchMode
from gpuwise.planning.setup import Optimizer

# bitsandbytes/optim/optimizer.py, Optimizer2State.init_state: blockwise 8-bit states keep one fp32 absmax per
# block of 256 elements since bitsandbytes 0.44 (bitsandbytes-foundation/bitsandbytes#1365; 2048 before).
BNB_BLOCK = 256
# min_8bit_size, the default of every bitsandbytes 8-bit optimizer: smaller parameters keep two fp32 states.
BNB_MIN_8BIT_SIZE = 4096
# Optimizer8bit.get_state_buffer: a paged optimizer puts a state in paged (CUDA unified) memory only from 1e5
# elements on; smaller states and every absmax are ordinary device memory.
BNB_PAGED_MIN_NUMEL = 100_000
# bitsandbytes' quantisation maps (F.create_dynamic_map): 256 fp32 values, signed and unsigned, one pair per
# optimizer (name2qmap), shared by all its parameters.
BNB_QMAP_VALUES = 256


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """What a plan needs to know about an optimizer beyond running it."""

    name: str
    stands_for: str
    states_follow_params: bool  # its states take the parameter's dtype (fp32 beside an fp32 master copy)
    paged: bool = False  # large states in paged memory: the driver can evict them to host memory


SPECS: dict[str, OptimizerSpec] = {s.name: s for s in (
    OptimizerSpec(name="adamw", stands_for="torch.optim.AdamW", states_follow_params=True),
    OptimizerSpec(name="sgd", stands_for="torch.optim.SGD (momentum 0.9)", states_follow_params=True),
    OptimizerSpec(name="adamw8bit", stands_for="bitsandbytes.optim.AdamW8bit", states_follow_params=False),
    OptimizerSpec(name="paged-adamw8bit", stands_for="bitsandbytes.optim.PagedAdamW8bit",
                  states_follow_params=False, paged=True),
    OptimizerSpec(name="adafactor", stands_for="torch.optim.Adafactor", states_follow_params=True),
    OptimizerSpec(name="lion", stands_for="lion_pytorch.Lion", states_follow_params=True),
)}
assert set(SPECS) == set(get_args(Optimizer)), "planning/setup.py's Optimizer and SPECS name the same optimizers"


class _NoValues(TorchDispatchMode):
    """Answer ``.item()`` of a fake tensor with 1: torch's Adafactor reads each parameter's norm as a Python float
    (its relative step size), which a fake tensor does not have; the state it allocates does not depend on it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return 1.0 if args[0].is_floating_point() else 1
        return func(*args, **(kwargs or {}))


class Adafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor (torch >= 2.5), steppable on fake tensors."""

    def init_state(self) -> None:
        """Allocate the state of every parameter with a gradient, as the first step does, without stepping: the
        planner records the second step (``_init_group``, private, is what ``step`` calls; since torch 2.5)."""
        for group in self.param_groups:
            self._init_group(group, [], [], [], [], [], [])

    @torch.no_grad()
    def step(self, closure=None):
        fake = any(isinstance(p, FakeTensor) for g in self.param_groups for p in g["params"])
        with _NoValues() if fake else contextlib.nullcontext():
            return super().step(closure)


class Lion(torch.optim.Optimizer):
    """lucidrains/lion-pytorch's ``Lion`` (Chen et al. 2023, arXiv:2302.06675): one momentum buffer per parameter,
    ``torch.zeros_like(p)``, and its update op for op (lion_pytorch/lion_pytorch.py, ``update_fn``), one
    parameter at a time, so its temporaries are two of the parameter being stepped."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def init_state(self) -> None:
        """Allocate the state of every parameter with a gradient, as the first step does, without stepping."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self, closure=None):
        self.init_state()
        for group in self.param_groups:
            lr, wd, (beta1, beta2) = group["lr"], group["weight_decay"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                exp_avg, grad = self.state[p]["exp_avg"], p.grad
                p.mul_(1 - lr * wd)
                update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
        return None


class AdamW8bit(torch.optim.Optimizer):
    """bitsandbytes' ``AdamW8bit`` / ``PagedAdamW8bit`` (``Optimizer2State``, 8 bits, blockwise): its state as
    ``init_state`` allocates it, and one in-place update per parameter reading and writing what its CUDA kernel
    (``optimizer_update_8bit_blockwise``) does, without temporaries. ``paged`` lists the states a paged optimizer
    keeps in unified memory."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, paged: bool = False) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.is_paged = paged
        self.paged: list[torch.Tensor] = []  # the states in paged memory
        self.qmaps: tuple[torch.Tensor, torch.Tensor] | None = None

    def _buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.zeros_like(p, dtype=dtype)
        if self.is_paged and p.numel() >= BNB_PAGED_MIN_NUMEL:
            self.paged.append(buf)
        return buf

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        state["step"] = 0
        if p.numel() < BNB_MIN_8BIT_SIZE:
            state["state1"], state["state2"] = self._buffer(p, torch.float32), self._buffer(p, torch.float32)
            return
        if self.qmaps is None:
            self.qmaps = (torch.zeros(BNB_QMAP_VALUES, dtype=torch.float32, device=p.device),
                          torch.zeros(BNB_QMAP_VALUES, dtype=torch.float32, device=p.device))
        state["state1"], state["qmap1"] = self._buffer(p, torch.uint8), self.qmaps[0]
        state["state2"], state["qmap2"] = self._buffer(p, torch.uint8), self.qmaps[1]
        blocks = -(-p.numel() // BNB_BLOCK)
        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def init_state(self) -> None:
        """Allocate the state of every parameter with a gradient, as the first step does (``init_state``)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state[p]:
                    self._init_state(p, self.state[p])

    @torch.no_grad()
    def step(self, closure=None):
        self.init_state()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] += 1
                # the kernel reads the gradient, the parameter and the states, and writes the parameter and states
                p.add_(p.grad, alpha=-group["lr"])
                torch._foreach_mul_([t for k, t in state.items() if k.startswith(("state", "absmax"))], 1)
        return None


def make_optimizer(name: str, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The optimizer ``--optimizer name`` stands for, over ``groups`` (torch's param-group dicts), as it runs on a
    GPU: torch's with ``foreach=True``, CUDA's default (the CPU default is the per-parameter loop)."""
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=1e-4, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9, foreach=True)
    if name == "adafactor":
        return Adafactor(groups, lr=1e-2, foreach=True)
    if name == "lion":
        return Lion(groups)
    if name in ("adamw8bit", "paged-adamw8bit"):
        return AdamW8bit(groups, paged=name == "paged-adamw8bit")
    raise ValueError(f"no optimizer {name!r}: one of {', '.join(SPECS)}")


def init_state(opt: torch.optim.Optimizer) -> None:
    """Create ``opt``'s state for the parameters that have gradients, as its first step does: without the step
    where the optimizer says how (ours, Adafactor), else by stepping (torch's AdamW and SGD: a few foreach ops)."""
    if hasattr(opt, "init_state"):
        opt.init_state()
    else:
        opt.step()


def state_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every tensor the optimizers hold in GPU memory as state (shared quantisation maps once). torch's optimizers
    keep their 0-d ``step`` counter on the host unless fused or capturable (``_init_group`` of AdamW, Adafactor),
    which the plan never asks for: left out."""
    out: list[torch.Tensor] = []
    for opt in optimizers:
        out += [v for state in opt.state.values() for k, v in state.items()
                if isinstance(v, torch.Tensor) and not (k == "step" and v.dim() == 0)]
    return out


def paged_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The states the optimizers keep in paged memory."""
    return [t for opt in optimizers for t in getattr(opt, "paged", ())]


@contextlib.contextmanager
def in_backward(optimizers: dict[torch.nn.Parameter, torch.optim.Optimizer], on_grad=None) -> Iterator[None]:
    """Step each parameter as soon as its gradient is accumulated, then free the gradient: the recipe of PyTorch's
    tutorial "How to save memory by fusing the optimizer step into the backward pass"
    (``Tensor.register_post_accumulate_grad_hook``) and of torchtune's ``optimizer_in_bwd``. ``on_grad(p)`` runs
    first (the tracker tags the gradient)."""

    def hook(p: torch.nn.Parameter) -> None:
        if on_grad is not None:
            on_grad(p)
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    handles = [p.register_post_accumulate_grad_hook(hook) for p in optimizers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
