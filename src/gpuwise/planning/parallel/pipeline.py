"""One stage of a pipeline-parallel run (``--pp``), captured as it runs (not a formula after).

The model stays plain PyTorch; these functions cut it from outside after it is built (gpt-fast's ``apply_tp``),
inside the fake mode, so the capture records what one rank allocates and computes.

``--pp N`` with the 1F1B schedule (Narayanan et al. 2021): a stage holds ``layers / N`` blocks; the first also the
embedding, the last the final norm, the head and the loss. A stage's output is sent on and its tensor freed
(Megatron's ``deallocate_output_tensor``): the first stage's capture stops after its last block and takes its
output gradient from the next stage in backward; the last stage's starts from a received activation. Stage i
holds ``min(N - i, micro-batches)`` micro-batches' activations at once (``in_flight``); the first stage, with the
most in flight, or the last, with the head, is the worst, and the plan reports that one.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from torch import nn

from gpuwise.errors import GpuwiseError
from gpuwise.planning.capture.tracker import CATEGORIES
from gpuwise.planning.parallel.layout import ends, in_flight_micro_batches, swap
from gpuwise.planning.setup import Setup


class _StageEnd(Exception):
    """Raised with the last block's output where a non-final pipeline stage stops."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__("end of the pipeline stage")
        self.x = x


class _Stop(nn.Module):
    """Stands where the final norm was: the stage sends its input on."""

    def forward(self, x, *args, **kwargs):
        raise _StageEnd(x)


class _Send(torch.autograd.Function):
    """The stage's output goes to the next stage (its tensor freed); in backward its gradient comes back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.meta = (x.shape, x.dtype, x.device)
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _grad: torch.Tensor) -> torch.Tensor:
        shape, dtype, device = ctx.meta
        return torch.empty(shape, dtype=dtype, device=device)  # the receive buffer


class _Recv(torch.autograd.Function):
    """The previous stage's activation arrives; its gradient is sent back (and freed) in backward."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=anchor.device)

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        return torch.zeros((), device=_grad.device), None, None


class _Received(nn.Module):
    """Stands where an embedding was: gives the activation the previous stage sent (the first), or nothing (0)."""

    def __init__(self, dim: int, dtype: torch.dtype, first: bool) -> None:
        super().__init__()
        self.dim, self.dtype, self.first = dim, dtype, first

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        shape = (*idx.shape, self.dim)
        if not self.first:  # learned positions: the first stage added them already
            return torch.zeros((), dtype=self.dtype, device=idx.device)
        anchor = torch.zeros((), device=idx.device, requires_grad=True)
        return _Recv.apply(anchor, shape, self.dtype)


def pipeline_stage(built, stage: int, pp: int):
    """``built`` (already holding this stage's blocks) as pipeline stage ``stage`` of ``pp`` runs it."""
    model = built.model
    embs, norm, head = ends(model)
    if not embs or norm is None or head is None:
        raise GpuwiseError(f"--pp {pp}: cannot tell the embedding, final norm and head of {type(model).__name__}",
                           "drop --pp; pipeline stages are planned for Llama- and GPT-style decoders")
    last = stage == pp - 1
    if stage > 0:  # the embedding lives on the first stage
        for i, name in enumerate(embs):
            old = model.get_submodule(name)
            swap(model, name, _Received(old.embedding_dim, old.weight.dtype, first=i == 0))
    if last:
        return built
    swap(model, norm, _Stop())  # the final norm, head and loss live on the last stage
    swap(model, head, nn.Identity())
    run = built.run

    def run_stage(model, inputs, targets, kv_cache):
        try:
            run(model, inputs, targets, kv_cache)
        except _StageEnd as end:
            return _Send.apply(end.x)
        raise RuntimeError("the pipeline stage ran past its last block")

    return replace(built, run=run_stage)


def in_flight(tl, setup: Setup):
    """``tl`` (one micro-batch of stage ``setup.stage``) with the activations of the other micro-batches 1F1B keeps
    in flight during forward and backward: each as many bytes as one leaves saved at the end of its forward."""
    extra = in_flight_micro_batches(setup) - 1
    if extra == 0:
        return tl
    act = CATEGORIES.index("activations")
    running = np.array([ph != "optimizer" for ph, _ in tl.labels])
    base, slope = tl.base.copy(), tl.slope.copy()
    base[running, act] += extra * tl.base[tl.end_of_forward, act]
    slope[running, act] += extra * tl.slope[tl.end_of_forward, act]
    return replace(tl, base=base, slope=slope)
