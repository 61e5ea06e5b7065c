"""The audio inputs of one step of a transformers speech model (hf_inputs.py asks here), its transcript's length,
and a stand-in for the CTC loss, whose real kernel reads the labels' values.

What is made, a batch of clips of ``audio_seconds`` each (``DEFAULT_AUDIO_SECONDS`` unless given):

- ``input_features`` as Whisper's feature extractor pads them: (batch, num_mel_bins, 2 x max_source_positions), 30 s
  of log-mel frames at 100 a second (the encoder refuses any other length; its convolutions halve it to
  max_source_positions); as Speech2Text's: (batch, frames, input_feat_per_channel x input_channels), 100 frames a
  second;
- ``input_values``, a waveform at 16 kHz (wav2vec2, HuBERT, WavLM, Data2VecAudio, SEW, UniSpeech: the feature encoder's
  convolutions ``conv_kernel`` / ``conv_stride``): (batch, samples).

``--seq`` is the transcript's length in tokens: the decoder's labels (Whisper, Speech2Text; default: all of
``max_target_positions``, as a batch padded to Whisper's longest transcript is at most), or the CTC labels (default:
``CHARACTERS_PER_SECOND`` a second of audio, within the encoder's output frames). A sample is a clip.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from typing import Any

import torch

from gpuwise.errors import GpuwiseError

FEATURES, VALUES = "input_features", "input_values"
SAMPLE_RATE = 16_000  # wav2vec2's and Whisper's feature extractors' sampling rate
FRAMES_PER_SECOND = 100  # log-mel and filter-bank features: a frame every 10 ms (Whisper, Speech2Text)
DEFAULT_AUDIO_SECONDS = 10.0  # an utterance (LibriSpeech's training clips average 12 s); Whisper's are always 30 s
CHARACTERS_PER_SECOND = 15  # read English speech, ~2.7 words a second: wav2vec2's CTC vocabulary is characters
DEFAULT_TARGET_TOKENS = 448  # Whisper's max_target_positions


def layout(what: str, config: Any) -> str | None:
    """How the model's audio input is laid out: ``whisper``, ``speech2text`` or ``waveform``; None for one the
    planner does not make (AST's spectrogram patches, codecs' multi-channel waveforms, Parakeet's features...)."""
    if what == FEATURES and _int(config, "num_mel_bins") and _int(config, "max_source_positions"):
        return "whisper"
    if what == FEATURES and _int(config, "input_feat_per_channel"):
        return "speech2text"
    if what == VALUES and isinstance(getattr(config, "conv_kernel", None), (list, tuple)) \
            and isinstance(getattr(config, "conv_stride", None), (list, tuple)):
        return "waveform"
    return None


def check(cls: type, config: Any, arch: str, *, seq: int | None, audio_seconds: float | None) -> None:
    """An audio layout the planner makes, a clip length the model takes, and a transcript that fits (one line each)."""
    what = getattr(cls, "main_input_name", None)
    kind = layout(what, config)
    if kind is None:
        raise GpuwiseError(f"{arch}'s forward takes {what} laid out as the planner does not make yet (it makes "
                           "Whisper's and Speech2Text's input_features and wav2vec2-style input_values)",
                           "plan your own model with --model file.py:function, whose function makes the inputs")
    if audio_seconds is not None and kind == "whisper" and audio_seconds != whisper_seconds(config):
        raise GpuwiseError(f"{arch}'s encoder takes {whisper_seconds(config):g} s clips only (its feature extractor "
                           "pads every clip to them)", "drop --audio-seconds")
    if audio_seconds is not None and clip_samples(config, audio_seconds, kind) < 1:
        raise GpuwiseError(f"an audio length of {audio_seconds:g} s is too short for {arch}",
                           "give at least a second of audio")
    if seq is None:
        return
    labels = label_kind(cls)
    if labels not in ("ctc", "decoder"):
        raise GpuwiseError(f"--seq does not apply to {arch}, which takes audio and no transcript", "drop --seq")
    most = max_target(cls, config, audio_seconds)
    if most is not None and seq > most:
        why = (f"the {most} frames its encoder makes of the audio (CTC needs a frame a label)" if labels == "ctc"
               else f"its {most} target positions")
        raise GpuwiseError(f"--seq {seq} (the transcript's tokens) is more than {arch}'s {why}",
                           f"pass --seq {most} or less")


def label_kind(cls: type | None) -> str | None:
    """``ctc`` (one label a character, aligned by the CTC loss), ``decoder`` (a decoder's target tokens), ``class``
    (one a clip), or None (no labels the planner makes: a bare encoder, x-vectors, frame classifiers)."""
    if cls is None or "labels" not in inspect.signature(cls.forward).parameters:
        return None
    name = cls.__name__
    if name.endswith("ForCTC"):
        return "ctc"
    if name.endswith("ForConditionalGeneration"):
        return "decoder"
    if name.endswith(("ForSequenceClassification", "ForAudioClassification")):
        return "class"
    return None


def whisper_seconds(config: Any) -> float:
    return 2 * int(config.max_source_positions) / FRAMES_PER_SECOND


def clip_samples(config: Any, audio_seconds: float | None, kind: str | None = None) -> int:
    """Frames (features) or samples (waveforms) of one clip."""
    seconds = DEFAULT_AUDIO_SECONDS if audio_seconds is None else audio_seconds
    if (kind or "waveform") == "waveform":
        return round(seconds * SAMPLE_RATE)
    return round(seconds * FRAMES_PER_SECOND)


def output_frames(config: Any, samples: int) -> int:
    """The frames wav2vec2's feature encoder makes of ``samples`` (its ``_get_feat_extract_output_lengths``)."""
    n = samples
    for kernel, stride in zip(config.conv_kernel, config.conv_stride, strict=False):
        n = (n - kernel) // stride + 1
    if getattr(config, "add_adapter", False):
        for _ in range(int(getattr(config, "num_adapter_layers", 0) or 0)):
            n = (n - 1) // int(config.adapter_stride) + 1
    return max(n, 0)


def max_target(cls: type, config: Any, audio_seconds: float | None) -> int | None:
    """The longest transcript: the decoder's positions, or a CTC label a frame."""
    if label_kind(cls) == "ctc":
        return output_frames(config, clip_samples(config, audio_seconds))
    return _int(config, "max_target_positions") or None


def target_tokens(cls: type, config: Any, seq: int | None, audio_seconds: float | None) -> int:
    """The transcript's tokens: ``--seq``, else all the decoder's positions, or CHARACTERS_PER_SECOND a second for
    CTC (within the output frames)."""
    if seq is not None:
        return seq
    most = max_target(cls, config, audio_seconds)
    if label_kind(cls) == "ctc":
        seconds = DEFAULT_AUDIO_SECONDS if audio_seconds is None else audio_seconds
        return max(1, min(math.ceil(CHARACTERS_PER_SECOND * seconds), most or 1))
    return min(DEFAULT_TARGET_TOKENS, most) if most else DEFAULT_TARGET_TOKENS


def make_audio(what: str, config: Any, batch: int, *, audio_seconds: float | None, dtype: torch.dtype) -> torch.Tensor:
    """A batch of clips laid out as ``layout`` says."""
    kind = layout(what, config)
    if kind == "whisper":
        return torch.randn(batch, int(config.num_mel_bins), 2 * int(config.max_source_positions), dtype=dtype)
    if kind == "speech2text":
        width = int(config.input_feat_per_channel) * int(getattr(config, "input_channels", 1) or 1)
        return torch.randn(batch, clip_samples(config, audio_seconds, kind), width, dtype=dtype)
    return torch.randn(batch, clip_samples(config, audio_seconds), dtype=dtype)


def make_labels(cls: type, config: Any, batch: int, target: int) -> torch.Tensor | None:
    """The transcript's token ids (CTC: no blank, transformers' ``pad_token_id``), or a class a clip."""
    kind, vocab = label_kind(cls), int(getattr(config, "vocab_size", None) or 32)
    if kind == "class":
        return torch.randint(max(int(getattr(config, "num_labels", 2)), 1), (batch,))
    if kind == "ctc":
        return torch.randint(1, max(vocab, 2), (batch, target))  # blank is id 0 in wav2vec2's vocabularies
    if kind == "decoder":
        return torch.randint(vocab, (batch, target))
    return None


class _CTC(torch.autograd.Function):
    """What ``torch.nn.functional.ctc_loss`` allocates, without reading the labels (a fake tensor has none): forward
    keeps the log-probabilities and the alphas (batch, frames, 2 x labels + 1) in fp32; backward makes the betas
    and the log-probabilities' gradient."""

    @staticmethod
    def forward(ctx, log_probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        frames, batch, _ = log_probs.shape
        alpha = log_probs.new_zeros(batch, frames, 2 * labels.shape[1] + 1)
        loss = log_probs.new_zeros(batch)
        ctx.save_for_backward(log_probs, labels, alpha, loss)
        return loss.mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        log_probs, _, alpha, _ = ctx.saved_tensors
        beta = torch.zeros_like(alpha)
        out = torch.zeros_like(log_probs) * grad
        del beta
        return out, None


def ctc_loss(model: torch.nn.Module, logits: torch.Tensor, labels: torch.Tensor,
             inputs: torch.Tensor) -> torch.Tensor:
    """transformers' ``ForCTCLoss`` as ``Wav2Vec2ForCTC.forward`` calls it (log-softmax in fp32, frames first), the
    CTC kernel replaced by ``_CTC``. The forward's attention mask of ones, a long a sample, lives until it returns."""
    mask = torch.ones_like(inputs, dtype=torch.long)
    lengths = mask.sum(-1)
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
    loss = _CTC.apply(log_probs, labels)
    del mask, lengths
    return loss


def every_layer(model: torch.nn.Module) -> None:
    """LayerDrop off: transformers skips a layer when ``torch.rand([]) < layerdrop`` in training (wav2vec2, HuBERT,
    WavLM default to 0.1), a fake tensor's value. The plan's step runs every layer, the step a run reaches when none
    is dropped (and every step under FSDP or ZeRO-3, which run them all)."""
    for name in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop"):
        if isinstance(getattr(model.config, name, None), float) and getattr(model.config, name) > 0:
            setattr(model.config, name, 0.0)
    for module in model.modules():
        if isinstance(getattr(module, "layerdrop", None), float) and module.layerdrop > 0:
            module.layerdrop = 0.0


def spec_augment(model: torch.nn.Module) -> None:
    """wav2vec2's SpecAugment (``_mask_hidden_states``: ``mask_time_prob`` 0.05 in training) assigns through a boolean
    mask, ``hidden_states[mask] = masked_spec_embed``, whose index (``nonzero``) a fake tensor cannot size. The same
    masks, drawn by transformers' own ``_compute_mask_indices``, applied with ``torch.where`` and ``masked_fill``."""
    for module in model.modules():
        compute = getattr(sys.modules.get(type(module).__module__), "_compute_mask_indices", None)
        if hasattr(module, "masked_spec_embed") and hasattr(module, "_mask_hidden_states") and compute is not None:
            module._mask_hidden_states = functools.partial(_mask_hidden_states, module, compute)


def _mask_hidden_states(module: torch.nn.Module, compute, hidden_states: torch.Tensor,
                        mask_time_indices: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                        **_: Any) -> torch.Tensor:
    config = module.config
    if not getattr(config, "apply_spec_augment", True):
        return hidden_states
    batch, frames, width = hidden_states.shape
    if mask_time_indices is None and config.mask_time_prob > 0 and module.training:
        mask = compute((batch, frames), mask_prob=config.mask_time_prob, mask_length=config.mask_time_length,
                       attention_mask=attention_mask, min_masks=config.mask_time_min_masks)
        mask_time_indices = torch.tensor(mask, device=hidden_states.device, dtype=torch.bool)
    if mask_time_indices is not None:
        embed = module.masked_spec_embed.to(hidden_states.dtype)
        hidden_states = torch.where(mask_time_indices[..., None], embed, hidden_states)
    if config.mask_feature_prob > 0 and module.training:
        mask = compute((batch, width), mask_prob=config.mask_feature_prob, mask_length=config.mask_feature_length,
                       min_masks=config.mask_feature_min_masks)
        mask = torch.tensor(mask, device=hidden_states.device, dtype=torch.bool)
        hidden_states = hidden_states.masked_fill(mask[:, None], 0)
    return hidden_states


def uses_ctc(model: torch.nn.Module) -> bool:
    return label_kind(type(model)) == "ctc"


def _int(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
