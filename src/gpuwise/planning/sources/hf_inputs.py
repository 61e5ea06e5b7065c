"""The inputs of one step of a transformers model, from its class and its config: what its main input is
(``main_input_name``, checked against ``forward``'s signature), its shape, and the labels its loss needs.

Token models get ``input_ids`` (batch, seq); image models ``pixel_values`` (batch, num_channels, height, width)
from the config's (or its ``vision_config``'s) ``num_channels`` and ``image_size`` (an int or a pair), which
``--image-size`` overrides. Speech models get clips of audio and their transcript (hf_audio.py): Whisper's and
Speech2Text's ``input_features``, wav2vec2's ``input_values``. An encoder-decoder without labels (``--task infer``,
a bare model) is given ``decoder_input_ids``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

import gpuwise.planning.sources.hf_audio as hf_audio
from gpuwise.compat import unset_fake_temporarily
from gpuwise.errors import GpuwiseError

TOKENS, PIXELS = "input_ids", "pixel_values"
FEATURES, VALUES = hf_audio.FEATURES, hf_audio.VALUES  # audio: log-mel frames, a waveform
AUDIO = (FEATURES, VALUES)
DEFAULT_IMAGE_SIZE = 224  # transformers' image processors' default where a config names no size (ResNet, RegNet)


def main_input(cls: type | None) -> str:
    """The argument of ``cls.forward`` that carries the data: transformers' ``main_input_name`` where ``forward``
    takes it, else ``input_ids`` (a class the config does not name is built as a causal LM)."""
    if cls is None:
        return TOKENS
    name = getattr(cls, "main_input_name", TOKENS)
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return name
    if name in params:
        return name
    return next((p for p in (TOKENS, PIXELS) if p in params), name)


def kind(cls: type | None) -> str | None:
    """What the main input holds: ``TOKENS``, ``PIXELS``, ``FEATURES`` or ``VALUES``; None for inputs the planner
    does not make (video...). Perceiver's heads take either as ``inputs``: images for its image classifiers, token ids
    for its masked LM and text classifier."""
    name = main_input(cls)
    if name == "inputs" and cls is not None:
        if "ForImageClassification" in cls.__name__:
            return PIXELS
        if cls.__name__.endswith(("ForMaskedLM", "ForSequenceClassification")):
            return TOKENS
    return name if name in (TOKENS, PIXELS, *AUDIO) else None


def check_input(cls: type | None, arch: str) -> None:
    """The planner makes token ids, images and audio; video and the rest are refused with their name."""
    if kind(cls) is None:
        raise GpuwiseError(f"{arch}'s forward takes {main_input(cls)}, an input the planner does not make yet (it "
                           f"makes {TOKENS}, {PIXELS}, {FEATURES} and {VALUES})", "plan a text, image or speech model "
                           "of this config, or your own model with --model file.py:function, whose function makes the "
                           "inputs")


def image_size(config: Any, override: int | None) -> tuple[int, int]:
    """(height, width) of the images: ``--image-size``, else the (vision) config's ``image_size``. An image smaller
    than one of the model's patches is the user's mistake, not a step that fails on fake tensors."""
    if override is not None:
        patch = getattr(_vision(config), "patch_size", None)
        patch = max(patch) if isinstance(patch, (list, tuple)) and patch else patch
        if isinstance(patch, int) and not isinstance(patch, bool) and override < patch:
            raise GpuwiseError(f"--image-size {override} is smaller than one {patch} x {patch} patch of this model",
                               f"pass --image-size {patch} or more (a multiple of {patch})")
        return override, override
    size = getattr(_vision(config), "image_size", None)
    if isinstance(size, int) and not isinstance(size, bool):
        return size, size
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(s, int) for s in size):
        return int(size[0]), int(size[1])
    if isinstance(size, dict) and isinstance(size.get("height"), int) and isinstance(size.get("width"), int):
        return size["height"], size["width"]
    return DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE


def make_input(what: str, config: Any, batch: int, *, seq: int, image: int | None,
               dtype: torch.dtype, audio_seconds: float | None = None) -> torch.Tensor:
    """The main input (``what``: TOKENS, PIXELS or one of AUDIO): token ids (batch, seq) below the vocabulary, images
    (batch, channels, height, width), or clips of ``audio_seconds`` (hf_audio.DEFAULT_AUDIO_SECONDS unless given)."""
    if what in AUDIO:
        return hf_audio.make_audio(what, config, batch, audio_seconds=audio_seconds, dtype=dtype)
    if what == PIXELS:
        channels = int(getattr(_vision(config), "num_channels", None) or 3)
        return torch.randn(batch, channels, *image_size(config, image), dtype=dtype)
    return _concrete(_token_ids, int(getattr(config, "vocab_size", None) or 32000), batch, seq,
                     getattr(config, "eos_token_id", None))


def _token_ids(vocab: int, batch: int, seq: int, eos: Any) -> torch.Tensor:
    """Random token ids, each sequence ending with the config's end-of-sequence token and holding no other, as a
    tokenizer makes them (BART's, mBART's and PLBart's classifiers pool the hidden state at that token and refuse a
    batch whose rows hold different numbers of it)."""
    ids = torch.randint(vocab, (batch, seq))
    if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < vocab and vocab > 1:
        ids[ids == eos] = (eos + 1) % vocab
        ids[:, -1] = eos
    return ids


def _concrete(factory: Any, *args: Any) -> torch.Tensor:
    """Token ids and class labels made for real (on the CPU), under the plan's fake tensors too: a few bytes a token,
    and where a model reads their values (XLM's and FlauBERT's lengths from the ids that are not padding, DeBERTa's
    labelled rows, ``labels >= 0``), the retry with concrete values (capture/step.py, routing.py) has them to read, as a
    real step on random tokens would."""
    with unset_fake_temporarily():
        return factory(*args)


def make_labels(model: torch.nn.Module, inputs: torch.Tensor, *, seq: int) -> torch.Tensor | None:
    """The labels the model's loss reads: a class per sample (sequence and image classifiers), per token (token
    classifiers), the tokens themselves (language models); None for a bare model, or one whose forward takes no
    labels (DeiT's with a teacher): its loss is the output's mean square."""
    arch, config, batch = type(model).__name__, model.config, inputs.shape[0]
    if "labels" not in inspect.signature(model.forward).parameters:
        return None
    if kind(type(model)) in AUDIO:  # the transcript, ``seq`` tokens (hf_audio.target_tokens), or a class a clip
        return hf_audio.make_labels(type(model), config, batch, seq)
    classes = max(int(getattr(config, "num_labels", 2)), 1)
    if arch.endswith(("ForSequenceClassification", "ForImageClassification")):
        return _concrete(torch.randint, classes, (batch,))
    if arch.endswith("ForTokenClassification"):
        return _concrete(torch.randint, classes, (batch, seq))
    if arch.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")) \
            and inputs.dtype == torch.long:
        return inputs
    return None


def _vision(config: Any) -> Any:
    """The config that describes the images: ``vision_config`` where the model has one (CLIP, SigLIP)."""
    return getattr(config, "vision_config", None) or config


def forward_options(model: torch.nn.Module, image: int | None) -> dict[str, Any]:
    """Keyword arguments of the step's forward besides the inputs: ``interpolate_pos_encoding=True`` where
    ``--image-size`` differs from the config's and ``forward`` takes it (ViT, DeiT, DINOv2...): the learned positions
    interpolated to the new grid, as transformers does to fine-tune at another resolution."""
    if image is None or image_size(model.config, None) == (image, image):
        return {}
    takes = "interpolate_pos_encoding" in inspect.signature(model.forward).parameters
    return {"interpolate_pos_encoding": True} if takes else {}


def decoder_inputs(model: torch.nn.Module, batch: int, *, seq: int) -> torch.Tensor | None:
    """``decoder_input_ids`` (batch, seq) for an encoder-decoder run without labels (from which it would shift them):
    ``--task infer`` as one teacher-forced forward, or a bare model (T5Model); None for a model without a decoder."""
    if "decoder_input_ids" not in inspect.signature(model.forward).parameters:
        return None
    vocab = getattr(model.config, "vocab_size", None) or getattr(model.config.get_text_config(), "vocab_size", None)
    return torch.randint(int(vocab or 32000), (batch, seq))


def check_decoder_start(cls: type | None, config: Any, arch: str) -> None:
    """An encoder-decoder trained on labels shifts them right behind ``config.decoder_start_token_id`` (T5's
    ``_shift_right``, BART's ``shift_tokens_right``): a config without one fails there (T5Config has no default),
    which is the config's omission, said before the step is simulated. mBART's shift takes no start token."""
    import sys

    if cls is None or not getattr(config, "is_encoder_decoder", False) \
            or getattr(config, "decoder_start_token_id", None) is not None:
        return
    if "labels" not in inspect.signature(cls.forward).parameters:
        return
    module = sys.modules.get(cls.__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return
    if "config.decoder_start_token_id" in source:
        pad = getattr(config, "pad_token_id", None)
        example = pad if isinstance(pad, int) else 0
        raise GpuwiseError(f"{arch}'s config has no decoder_start_token_id, the token its decoder starts from when it "
                           "is trained on labels", f"add decoder_start_token_id to config.json: {example}, say (T5's "
                           "published configs start from the pad token, 0; BART's from 2), or plan --task infer")


def settle(model: torch.nn.Module) -> None:
    """What a step needs set that a config.json may leave unset: X-MOD's ``default_language`` (its forward refuses to
    run without one, or ``lang_ids``), the first of its ``languages``: every language's adapter is the same size, so
    the step's memory and FLOPs do not depend on which."""
    config = model.config
    languages = getattr(config, "languages", None)
    if hasattr(config, "default_language") and config.default_language is None and languages:
        config.default_language = next(iter(languages))
