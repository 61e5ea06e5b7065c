"""The losses a training step takes from the model's output, and what is said when a step's loss is not finite.

>>> # loss = default_loss(model, x, y)   # cross-entropy for integer targets, MSE for float ones
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from gpuwise.errors import GpuwiseError

LossFn = Callable[[nn.Module, Any, Any], torch.Tensor]


def default_loss(model: nn.Module, x: Any, y: Any) -> torch.Tensor:
    """The model's output is the loss when there is no target (or when it is a scalar); with a target,
    cross-entropy for integer targets (logits last), mean squared error for float ones."""
    if isinstance(x, Mapping):  # Hugging Face style: input_ids, attention_mask, labels as keywords
        out = model(**x)
        y = x.get("labels") if y is None else y
    else:
        out = model(*x) if isinstance(x, tuple) else model(x)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, Mapping) or hasattr(out, "logits"):  # a dict or a ModelOutput without a loss: its logits
        logits = out.get("logits") if isinstance(out, Mapping) else out.logits
        if not isinstance(logits, torch.Tensor):
            keys = ", ".join(map(str, out)) if isinstance(out, Mapping) else type(out).__name__
            raise GpuwiseError(f"the model's forward returns {type(out).__name__} ({keys}) with no 'loss' or "
                               "'logits' tensor", "return the loss, or a dict with 'loss' or 'logits'")
        if y is None:
            raise GpuwiseError("the model returns logits but no loss, and the data has no targets",
                               "give the items a target or 'labels', or return the loss from forward")
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1),
                                           ignore_index=-100)  # -100: Hugging Face's "not a target"
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise GpuwiseError(f"the model's forward returns {type(out).__name__}, not a tensor",
                           "return the loss, the logits, or a dict with 'loss' or 'logits'")
    if y is None or out.dim() == 0:
        return out if out.dim() == 0 else out.float().square().mean()
    if y.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
    if out.shape != y.shape:
        if out.numel() != y.numel():
            raise GpuwiseError(f"the model's output {tuple(out.shape)} and the float targets {tuple(y.shape)} "
                               "differ in size: MSE would broadcast them into a matrix and train on the wrong pairs",
                               "make the output the targets' shape (a regression head of 1 output: "
                               "out.squeeze(-1)), or return the loss from the model")
        raise GpuwiseError(f"the model's output {tuple(out.shape)} and the float targets {tuple(y.shape)} have the "
                           "same values but not the same shape: MSE would broadcast (B, 1) against (B,) into (B, B)",
                           "squeeze or reshape one to the other's shape (out.squeeze(-1), or y.unsqueeze(-1))")
    return nn.functional.mse_loss(out.float(), y.float())


def model_loss(model: nn.Module, x: Any, y: Any) -> torch.Tensor:
    """For models whose forward(inputs, targets) returns the loss (the built-in GPT, the image CNN)."""
    return model(x, y)


def scalar(loss: Any) -> torch.Tensor:
    """``loss`` if it is a scalar tensor; else the one-line error that says what the loss function returned."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise GpuwiseError(f"the loss is {type(loss).__name__}"
                           f"{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}, "
                           "not a scalar tensor", "return a scalar loss from the model or loss_fn")
    return loss


def non_finite_loss(loss: torch.Tensor, x: Any, y: Any, *, step: int, skipped_steps: int) -> GpuwiseError:
    """Why the loss of ``step`` is NaN or Inf: the data first (no learning rate cures a NaN input), else the
    learning rate or fp16's range."""
    for what, part in (("inputs", x), ("targets", y)):
        bad = non_finite(part)
        if bad:
            return GpuwiseError(f"the batch of step {step} holds {bad} in its {what}, and the loss is {loss.item()}",
                                "clean the data (torch.nan_to_num, or drop those items) in the Dataset")
    return GpuwiseError(f"the loss is {loss.item()} at step {step}",
                        "lower --lr, or use --precision bf16-mixed (fp16 overflows where bf16 does not)"
                        + (f"; the fp16 scaler skipped {skipped_steps} steps before" if skipped_steps else ""))


def non_finite(x: Any) -> str | None:
    """"NaN" or "Inf" where a floating tensor in ``x`` (a tensor, tuple or dict of them) holds one, else None."""
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            return None
        return "NaN" if torch.isnan(x).any() else "Inf" if torch.isinf(x).any() else None
    parts = x.values() if isinstance(x, Mapping) else x if isinstance(x, (tuple, list)) else ()
    return next((bad for bad in map(non_finite, parts) if bad), None)
