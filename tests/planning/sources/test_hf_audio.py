"""Hugging Face speech and encoder-decoder models planned (issue 17): audio made from the config
(sources/hf_audio.py), the transcript as labels, the CTC loss's stand-in, decoder inputs; the planned peak against
PyTorch's MemTracker on the same step run for real on the CPU, the parameters against the model transformers builds."""

from __future__ import annotations

import contextlib
import functools
import json
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from conftest import run_cli

transformers = pytest.importorskip("transformers")

WHISPER = {"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"], "d_model": 64,
           "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
           "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "vocab_size": 1000, "num_mel_bins": 80,
           "max_source_positions": 100, "max_target_positions": 64, "pad_token_id": 0, "bos_token_id": 1,
           "eos_token_id": 1, "decoder_start_token_id": 2}
# wav2vec2's own feature encoder (7 convolutions, 320 samples a frame), 16 channels wide; LayerDrop (0.1) and
# SpecAugment (mask_time_prob 0.05) at their defaults. Dropout off: on the CPU it keeps a float mask (4 bytes an
# element) and SDPA with dropout falls back to the math kernel, where CUDA keeps a bool mask and a fused kernel.
WAV2VEC2 = {"model_type": "wav2vec2", "architectures": ["Wav2Vec2ForCTC"], "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 32, "conv_dim": [16] * 7,
            "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4, "attention_dropout": 0.0,
            "hidden_dropout": 0.0, "activation_dropout": 0.0, "final_dropout": 0.0}
T5 = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 64, "d_ff": 128, "d_kv": 16,
      "num_heads": 4, "num_layers": 2, "vocab_size": 1000, "pad_token_id": 0, "eos_token_id": 1}


def _path(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _plan(cfg: dict, **setup):
    from gpuwise.planning import Setup, plan_model

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_model(None, Setup(**setup), hf_config=_path(Path(tmp), cfg), gpu="h100")


def _real(cfg: dict, device: str = "meta"):
    conf = transformers.AutoConfig.for_model(**cfg)
    conf._attn_implementation = "sdpa"
    with torch.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, cfg["architectures"][0])(conf)


@contextlib.contextmanager
def _frozen_ok():
    """MemTracker hooks every parameter's gradient, which a frozen one (Whisper's encoder positions) refuses."""
    class Handle:
        def remove(self):
            pass

    hook, post = torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook
    torch.Tensor.register_hook = lambda t, h: hook(t, h) if t.requires_grad else Handle()
    torch.Tensor.register_post_accumulate_grad_hook = lambda t, h: post(t, h) if t.requires_grad else Handle()
    try:
        yield
    finally:
        torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook = hook, post


def _memtracker_peak(cfg: dict, inputs: dict) -> int:
    """One fp32 AdamW step of ``cfg`` run for real on the CPU (transformers' own loss, the CTC kernel included),
    its optimizer state already made; LayerDrop off as in the plan (every layer runs)."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    from gpuwise.optim import param_groups
    from gpuwise.planning.sources.hf import _real_masks

    torch.manual_seed(0)
    model = _real(cfg, "cpu").train()
    model.config.layerdrop = 0.0
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-4, foreach=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    opt.step()
    opt.zero_grad(set_to_none=True)
    with _frozen_ok(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mt = mem_tracker.MemTracker()
        mt.track_external(model, opt)
        with mt, _real_masks():
            model(**inputs).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return int(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


SPEECH = {"whisper": WHISPER, "wav2vec2-ctc": WAV2VEC2}


@functools.cache
def _planned(name: str):
    """The fp32 plan of a training step at batch 2, made once for the two tests that read it."""
    return _plan(SPEECH[name], micro_batch=2, precision="fp32")


@pytest.mark.parametrize("name", SPEECH)
def test_speech_model_plans_with_the_real_parameters(name):
    """Whisper (30 s of mel frames as its encoder takes them, here 2 x 100; a 64-token transcript, all its target
    positions) and wav2vec2 with a CTC head (10 s at 16 kHz, 150 characters) plan with the parameters of the model
    transformers builds. A sample is a clip: tokens_per_step counts clips."""
    plan = _planned(name)
    assert plan.params == sum(p.numel() for p in _real(SPEECH[name]).parameters())
    assert plan.tokens_per_step == 2


@pytest.mark.parametrize("name", SPEECH)
def test_speech_model_peak_against_memtracker(name):
    """The fp32 step's planned peak against MemTracker's on the same step run for real on the CPU, with
    transformers' own loss (the CTC kernel, not the plan's stand-in): 0.99x for Whisper, 1.00x for wav2vec2 when
    written."""
    if name == "whisper":
        inputs = {"input_features": torch.randn(2, 80, 200), "labels": torch.randint(1000, (2, 64)),
                  "use_cache": False}
    else:
        inputs = {"input_values": torch.randn(2, 160_000), "labels": torch.randint(1, 32, (2, 150))}
    real = _memtracker_peak(SPEECH[name], inputs)
    assert 0.97 < _planned(name).peak_bytes / real < 1.03, (_planned(name).peak_bytes, real)


def test_audio_is_made_as_the_models_take_it():
    """Whisper's clip is fixed by its positions, wav2vec2's CTC frames are the feature encoder's (transformers' own
    output-length formula), the transcript's default fits them."""
    import gpuwise.planning.sources.hf_audio as hf_audio
    import gpuwise.planning.sources.hf_inputs as hf_inputs

    whisper, w2v = _real(WHISPER), _real(WAV2VEC2)
    cls = type(w2v)
    features = hf_inputs.make_input(hf_inputs.FEATURES, whisper.config, 3, seq=1, image=None, dtype=torch.float32)
    assert features.shape == (3, 80, 200)
    values = hf_inputs.make_input(hf_inputs.VALUES, w2v.config, 2, seq=1, image=None, dtype=torch.float32,
                                  audio_seconds=2.5)
    assert values.shape == (2, 40_000)
    for samples in (16_000, 40_000, 160_000):
        assert hf_audio.output_frames(w2v.config, samples) == int(w2v._get_feat_extract_output_lengths(samples))
    assert hf_audio.target_tokens(cls, w2v.config, None, None) == 150  # 15 characters a second of 10 s
    assert hf_audio.target_tokens(cls, w2v.config, None, 0.1) == 2  # rounded up
    assert hf_audio.target_tokens(type(whisper), whisper.config, None, None) == 64  # max_target_positions
    with pytest.raises(Exception, match="2 s clips only"):
        hf_audio.check(type(whisper), whisper.config, "Whisper", seq=None, audio_seconds=10.0)


@pytest.mark.parametrize(("cfg", "flags", "says"), [
    (T5, [], "decoder_start_token_id"),
    (WHISPER, ["--seq", "65"], "--seq 64"),
    (WAV2VEC2, ["--seq", "500"], "--seq 499"),
    (dict(WAV2VEC2, architectures=["Wav2Vec2ForSequenceClassification"]), ["--seq", "16"], "drop --seq"),
    (WHISPER, ["--image-size", "64"], "drop --image-size"),
    (WHISPER, ["--audio-seconds", "10"], "drop --audio-seconds"),
    (dict(T5, decoder_start_token_id=0), ["--audio-seconds", "10"], "drop --audio-seconds"),
    (WAV2VEC2, ["--audio-seconds", "inf"], "--audio-seconds 10"),
], ids=["t5-no-decoder-start", "whisper-seq", "ctc-seq", "audio-classifier-seq", "whisper-image-size",
        "whisper-clip", "text-audio-seconds", "audio-seconds-inf"])
def test_config_and_flag_errors_are_one_line(capsys, tmp_path, cfg, flags, says):
    """Said before the step is simulated: T5's config without decoder_start_token_id failed on fake tensors
    ("'T5Config' object has no attribute ...", blamed on them); a transcript longer than the model's positions or
    its CTC frames; a flag for another kind of input."""
    code, out, err = run_cli(capsys, "plan", "--hf-config", _path(tmp_path, cfg), *flags)
    assert code == 2 and not out, err
    assert err.startswith("error: ") and says in err and "Traceback" not in err
    assert err.count("\n") == 1, err


def test_t5_plans_with_a_decoder_start_token():
    """With decoder_start_token_id (0, as T5's published configs), T5 trains on labels (its inputs) and infers from
    decoder inputs as long as its inputs, the parameters as transformers builds them."""
    cfg = dict(T5, decoder_start_token_id=0)
    n = sum(p.numel() for p in _real(cfg).parameters())
    train = _plan(cfg, micro_batch=2, seq=32, precision="fp32")
    infer = _plan(cfg, micro_batch=2, seq=32, task="infer")
    assert train.params == infer.params == n
    assert train.tokens_per_step == 64 and infer.peak_bytes < train.peak_bytes


def test_audio_seconds_sizes_the_clip(capsys, tmp_path):
    """--audio-seconds reaches the clip: wav2vec2's inputs are 16,000 fp32 samples a second (64,000 B a clip-second),
    planned at inference where nothing else in the step grows with the transcript."""
    inputs = {}
    for seconds in ("1", "2"):
        code, out, err = run_cli(capsys, "plan", "--hf-config", _path(tmp_path, WAV2VEC2), "--task", "infer",
                                 "--precision", "fp32", "--audio-seconds", seconds, "--json")
        assert code == 0, err
        inputs[seconds] = json.loads(out)["breakdown"]["inputs"]
    assert inputs["2"] - inputs["1"] == 16_000 * 4
