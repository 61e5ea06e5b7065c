"""What ``gpuwise train`` trains: the character GPT on Python's own text, a small CNN on synthetic images, the
user's model (``--model file.py:function``) or transformers' model of a config (``--hf-config``, a path or a Hub id)
on the user's data (``--data file.py:function``).

A task bundles the model factory, the training and held-out data, the loss, and the planner's view of the
same step (a source), so ``--auto`` and the MFU figure describe exactly what is trained.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gpuwise.errors import GpuwiseError, first_line
from gpuwise.files import file_function
from gpuwise.training.data import CharText, DatasetBatches, Fixed, SyntheticImages
from gpuwise.training.loss import LossFn, default_loss, model_loss


class SmallCNN(nn.Module):
    """Three conv stages (32, 64, 128 channels; the last two stride 2), global average pool, a linear head.
    GroupNorm rather than BatchNorm: a sample's output does not depend on the others in its micro-batch,
    so accumulation and data parallelism give the same step as one big batch."""

    def __init__(self, classes: int = 10, channels: int = 3, width: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = channels
        for i, c_out in enumerate((width, 2 * width, 4 * width)):
            layers += [nn.Conv2d(c_in, c_out, 3, stride=1 if i == 0 else 2, padding=1, bias=False),
                       nn.GroupNorm(8, c_out), nn.ReLU(inplace=True)]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, images: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(self.features(images).mean(dim=(2, 3)))
        return logits if targets is None else F.cross_entropy(logits.float(), targets)


@dataclass(frozen=True, kw_only=True)
class FunctionSource:
    """The planner's view of a model built by a Python function ``fn(batch) -> (model, inputs)``."""

    name: str
    fn: Callable[[int], Any]
    n_layer = None

    def check(self, setup) -> None:
        pass

    def tokens(self, setup) -> int:
        return 1

    def build(self, setup, batch: int, n_layer: int | None):
        from gpuwise.planning.sources.file import build_function

        return build_function(self.name, self.fn, setup, batch)


@dataclass(frozen=True, kw_only=True)
class Task:
    name: str
    build: Callable[[], nn.Module]  # the model, on the current default device
    data: Any
    eval_data: Any
    loss_fn: LossFn
    source: Any  # what the planner captures: the same model and step
    unit: str  # "tokens" or "samples"
    seq: int | None = None


def text_task(seq: int, seed: int, loss: str = "standard") -> Task:
    from gpuwise.models import get_model
    from gpuwise.models.gpt import GPT, GPTConfig
    from gpuwise.planning.sources.zoo import ZooSource

    if not 8 <= seq <= 1024:
        raise GpuwiseError(f"--seq {seq} is outside 8..1024 characters", "pass e.g. --seq 128")
    data = CharText(seq=seq, seed=seed)
    gpt = GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=data.vocab_size, block_size=seq, loss=loss)
    zoo = replace(get_model("gpt2"), config=gpt, default_seq=seq, max_seq=seq)
    return Task(name="char-gpt", build=lambda: GPT(gpt), data=data, eval_data=CharText(seq=seq, seed=seed,
                split="val", text=data.text), loss_fn=model_loss, source=ZooSource(zoo=zoo), unit="tokens", seq=seq)


def image_task(image_size: int, seed: int) -> Task:
    if not 8 <= image_size <= 512:
        raise GpuwiseError(f"--image-size {image_size} is outside 8..512", "pass e.g. --image-size 32")
    data = SyntheticImages(size=image_size, seed=seed)

    def example(batch: int):
        images = torch.randn(batch, data.channels, image_size, image_size)
        return SmallCNN(data.classes, data.channels), (images, torch.randint(data.classes, (batch,)))

    return Task(name="small-cnn", build=lambda: SmallCNN(data.classes, data.channels), data=data,
                eval_data=replace(data, split="val"), loss_fn=model_loss,
                source=FunctionSource(name="small-cnn", fn=example), unit="samples")


def file_task(model_spec: str, data_spec: str | None, batch: int, seed: int, workers: int, *,
              say: Callable[[str], None] | None = None, data_timeout: float | None = None) -> Task:
    """``function(batch_size)`` returns ``(model, inputs)`` as for ``gpuwise plan``; ``--data``'s function
    returns a Dataset of ``(input, target)`` items (or ``(train, val)`` Datasets): ``say`` hears a line while it
    keeps the run waiting, ``data_timeout`` bounds the wait (``waiting.Watchdog``)."""
    from gpuwise.planning.sources.file import FileSource, call_model_function

    path, name = file_function(model_spec, "--model")
    source = FileSource(path=path, function=name)
    fn = _no_exit(source.load, f"importing {path.name}")

    def build_real(rows: int):
        return _no_exit(lambda: call_model_function(source.name, fn, rows, fake=False), f"{path.name}:{name}()")

    if data_spec is None:
        with torch.random.fork_rng(devices=[]):  # the same example inputs in every run and every process
            torch.manual_seed(seed)
            _, inputs = build_real(batch)
        data, eval_data = Fixed(inputs), None
    else:
        data, eval_data = _user_data(data_spec, seed, workers, say=say, timeout=data_timeout)

    def build() -> nn.Module:
        model, _ = build_real(1)
        return model.to(torch.get_default_device())

    return Task(name=source.name, build=build, data=data, eval_data=eval_data, loss_fn=default_loss,
                source=source, unit="samples")


@dataclass(frozen=True)
class FixedLabelled:
    """The same keyword inputs and labels every step (``--hf-config`` without ``--data``): on one repeated batch
    the loss falls as the model learns it by heart, which shows the loop trains."""

    inputs: Mapping[str, torch.Tensor]  # the model's main input by name: input_ids, pixel_values...
    labels: torch.Tensor  # what its loss reads: the token ids again (a causal LM), a class a sample...

    def batch(self, number: int, size: int) -> tuple[Mapping[str, torch.Tensor], torch.Tensor]:
        return self.inputs, self.labels


def hf_task(hf_config: str, data_spec: str | None, seq: int | None, batch: int, seed: int, workers: int, *,
            say: Callable[[str], None] | None = None, data_timeout: float | None = None) -> Task:
    """transformers' model of ``--hf-config`` (a config.json, a folder, a checkpoint file or a Hub id), built for
    real with random weights as ``gpuwise plan --hf-config`` builds it (the class config.json names, the same
    attention), and trained with its own loss: on ``--data``'s Dataset, else on one batch of random inputs fixed by
    the seed (token ids below the vocabulary, and the labels its loss reads: the ids themselves for a causal LM)."""
    import warnings

    from gpuwise.compat import FakeTensor, fake_tensor_mode
    from gpuwise.planning.setup import Setup
    from gpuwise.planning.sources import hf_inputs
    from gpuwise.planning.sources.resolve import resolve_source
    from gpuwise.training.config import HF_SEQ

    source = resolve_source(None, hf_config)
    arch = (source.config.get("architectures") or [source.config["model_type"]])[0]
    main = hf_inputs.main_input(source.model_class)  # input_ids, pixel_values, input_features...
    tokens = hf_inputs.kind(source.model_class) == hf_inputs.TOKENS
    if seq is not None and not tokens:
        raise GpuwiseError(f"--seq does not apply to {arch}, which takes {main}", "drop --seq")
    if tokens and seq is None:
        seq = min(HF_SEQ, source.max_positions or HF_SEQ)
    setup = Setup(seq=seq, precision="fp32")
    source.check(setup)  # --seq beyond the config's positions, inputs transformers' model does not take

    if data_spec is None:
        # the planner's own inputs for the step (hf_inputs.py), made on fake tensors: nothing of the model is
        # allocated. Token ids and class labels come real from there; images and audio are drawn here
        with torch.random.fork_rng(devices=[]), fake_tensor_mode(allow_non_fake_inputs=True), \
                torch.device("cpu"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(seed)
            example = source.build(setup, batch, None)
        if example.targets is None:
            raise GpuwiseError(f"{arch} has no head whose loss takes labels: transformers computes no loss to "
                               "train", "name a class with a head in config.json's architectures, e.g. "
                               "LlamaForCausalLM for a LlamaModel")
        g = torch.Generator().manual_seed(seed)

        def real(t: torch.Tensor, what: str) -> torch.Tensor:
            if not isinstance(t, FakeTensor):
                return t
            if not t.is_floating_point():
                raise GpuwiseError(f"gpuwise makes no random {what} for {arch}",
                                   "pass --data file.py:function returning a Dataset of its inputs and labels")
            return torch.randn(t.shape, generator=g, dtype=t.dtype)

        labels = real(example.targets, "labels")
        data, eval_data = FixedLabelled(inputs={main: real(example.inputs[0], main)}, labels=labels), None
        unit = "tokens" if tokens and labels.dim() > 1 else "samples"  # what the Trainer counts: labels' elements
    else:
        data, eval_data = _user_data(data_spec, seed, workers, say=say, timeout=data_timeout)
        unit = "samples"

    def build() -> nn.Module:
        model = source.build(setup, 1, None).model  # for real: random weights, on the current default device
        if getattr(model.config, "use_cache", None) is not None:
            model.config.use_cache = False  # a training step keeps no KV cache (as the planned step runs it)
        return model

    return Task(name=source.name, build=build, data=data, eval_data=eval_data, loss_fn=hf_loss(main),
                source=source, unit=unit, seq=seq)


def hf_loss(main: str) -> LossFn:
    """The model's own loss, which transformers computes from the labels (a causal LM's shifted by one token): a
    batch's tensor input passed as ``main`` (input_ids, pixel_values...), its target as ``labels``; the rest as
    ``default_loss`` takes it (a dict of keyword inputs that holds the labels itself)."""
    def loss(model: nn.Module, x: Any, y: Any) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            x = {main: x}
        if isinstance(x, Mapping) and isinstance(y, torch.Tensor) and "labels" not in x:
            x = {**x, "labels": y}
        return default_loss(model, x, y)

    return loss


def _user_data(data_spec: str, seed: int, workers: int, *, say: Callable[[str], None] | None = None,
               timeout: float | None = None) -> tuple[DatasetBatches, DatasetBatches | None]:
    """``--data file.py:function``: the training Dataset it returns, and the held-out one if it returns two. A
    function that keeps the run waiting is said to (``say``), and stopped after ``timeout`` seconds if given."""
    from gpuwise.planning.sources.file import FileSource
    from gpuwise.training.waiting import Watchdog

    data_path, data_name = file_function(data_spec, "--data")
    data_fn = _no_exit(FileSource(path=data_path, function=data_name).load, f"importing {data_path.name}")
    called = f"{data_path.name}:{data_name}()"
    try:
        with Watchdog(say, timeout) as dog, dog.waiting(lambda: f"{called} to return",
                                                       "the function should build the Dataset and return it: "
                                                       "download or preprocess once, outside it"):
            made = _no_exit(data_fn, called)
    except GpuwiseError:
        raise
    except Exception as exc:
        raise GpuwiseError(f"{data_path.name}:{data_name}() raised {first_line(exc)}",
                           "fix the function; it takes no arguments and returns a Dataset") from exc
    train, val = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    return (DatasetBatches(train, seed=seed, workers=workers),
            DatasetBatches(val, seed=seed, workers=workers) if val is not None else None)


def _no_exit(call: Callable[[], Any], what: str) -> Any:
    """``call()``, with a ``sys.exit`` in the user's code turned into a one-line error instead of a silent exit."""
    try:
        return call()
    except SystemExit as exc:
        raise GpuwiseError(f"{what} called sys.exit({exc.code})",
                           "guard the script part with if __name__ == '__main__', or raise an exception") from None
