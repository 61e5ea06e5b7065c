"""A Hugging Face ``config.json`` as a source (``--hf-config``), built with transformers' ``from_config`` (extra
``gpuwise[hf]``) inside the fake mode: nothing is downloaded. hf_build.py, hf_inputs.py and hf_audio.py hold what the
build, the inputs and the speech models need."""

from __future__ import annotations

import contextlib
import copy
import difflib
import inspect
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gpuwise.planning.sources.hf_audio as hf_audio
import gpuwise.planning.sources.hf_inputs as hf_inputs
from gpuwise.compat import DataDependentOutputException, tree_leaves
from gpuwise.errors import GpuwiseError, first_line
from gpuwise.files import TooDeep
from gpuwise.models.loss import IGNORE_INDEX, causal_lm_loss
from gpuwise.planning.capture.blocks import Misaligned, find_blocks, kinds_of, signatures
from gpuwise.planning.experts import Experts, experts_of
from gpuwise.planning.setup import Attention, Setup
from gpuwise.planning.sources.base import Built, Decoder, check_decode, scalar_loss
from gpuwise.planning.sources.checkpoint import (
    CheckpointInfo,
    checkpoint_info,
    gguf_config,
    read_gguf,
    safetensors_files,
)
from gpuwise.planning.sources.hf_build import concrete_constants, top1_routers
from gpuwise.planning.sources.hf_config import (
    HEADS,
    LAYERS,
    WIDTH,
    as_transformers_reads,
    check_sizes,
    read_config,
)

_MAX_LAYERS = 10_000  # Llama 3.1 405B has 126 blocks
# config.json's keys for the stack's depth, the attention heads and the width: transformers' standard names, then
# GPT-2's (GPT2Config's attribute_map: n_layer, n_head, n_embd)
# --attention -> the attn_implementation transformers builds with: FlashAttention-2 and FlexAttention run as SDPA,
# whose CPU flash kernel keeps what the CUDA kernels keep (the output and its logsumexp). transformers'
# "flash_attention_2" needs the flash_attn package and a CUDA device, and its "flex_attention" compiles a kernel that
# crashes on fake CPU tensors (torch 2.13: a segmentation fault), so neither builds here; the Setup names the kernel
_BUILT_AS = {"eager": "eager", "sdpa": "sdpa", "flash": "sdpa", "flex": "sdpa"}
# the class flags transformers checks before it sets each implementation (PreTrainedModel._supports_sdpa, ...)
_SUPPORTS = {"sdpa": "_supports_sdpa", "flash": "_supports_flash_attn", "flex": "_supports_flex_attn"}
_TRANSFORMERS_NAME = {"sdpa": "sdpa", "flash": "flash_attention_2", "flex": "flex_attention"}


@dataclass(frozen=True, kw_only=True)
class HFSource:
    """A Hugging Face ``config.json``, built with transformers' ``from_config`` (extra ``gpuwise[hf]``)."""

    path: Path
    config: dict
    label: str | None = None  # the name the user gave (a Hub id); None: config.json's _name_or_path, or model_type
    checkpoint: CheckpointInfo | None = None  # the weights as stored beside config.json (checkpoint.py)

    @classmethod
    def from_path(cls, path: Path, *, label: str | None = None) -> HFSource:
        """A config.json, a folder holding one (and maybe its safetensors), a ``.safetensors`` file beside its
        config.json, or a ``.gguf`` file (its config from the GGUF metadata); the weights as stored read too."""
        files = None
        if path.suffix == ".gguf" and path.is_file():
            return cls._checked(path, gguf_config(path), label or path.name, read_gguf(path))
        if path.suffix == ".safetensors" and path.is_file():
            shards = safetensors_files(path.parent)
            files, path = (shards if path in shards else (path,)), path.parent / "config.json"
            if not path.is_file():
                raise GpuwiseError(f"no config.json beside {files[0]}: a safetensors file holds the weights, not "
                                   "the architecture", "put the model's config.json in its folder, or pass "
                                   "--hf-config with a Hub id")
        if path.is_dir():
            path = path / "config.json"
        try:
            config = read_config(path)
        except FileNotFoundError:
            raise GpuwiseError(f"no such file: {path}", "pass --hf-config path/to/config.json") from None
        except TooDeep as exc:
            raise GpuwiseError(f"{path} is no config.json: {exc}", "pass a Hugging Face config.json") from None
        except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
            raise GpuwiseError(f"{path} is not valid JSON: {exc}", "pass a Hugging Face config.json") from None
        info = checkpoint_info(config, path.parent, files) if isinstance(config, dict) else None
        return cls._checked(path, config, label, info)

    @classmethod
    def _checked(cls, path: Path, config: Any, label: str | None, info: CheckpointInfo | None) -> HFSource:
        """``config`` checked, then as transformers reads it (``as_transformers_reads``)."""
        if not isinstance(config, dict) or "model_type" not in config:
            raise GpuwiseError(f"{path} has no model_type", "pass a Hugging Face config.json")
        if not isinstance(config["model_type"], str):
            raise GpuwiseError(f"{path}: model_type {config['model_type']!r:.60} is not a name",
                               'write e.g. "model_type": "llama"')
        archs = config.get("architectures")
        if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise GpuwiseError(f"{path}: architectures {archs!r} is not a list of class names",
                               'write e.g. "architectures": ["LlamaForCausalLM"], or drop it')
        for key in ("num_hidden_layers", "n_layer", "num_layers"):  # before anything is built from it
            layers = config.get(key)
            if isinstance(layers, int) and layers > _MAX_LAYERS:
                raise GpuwiseError(f"{path}: {key} {layers:,} is more blocks than any model has "
                                   f"(the most gpuwise plans is {_MAX_LAYERS:,})", f"check {key} in config.json")
        check_sizes(path, config)
        return cls(path=path, config=as_transformers_reads(path, config), label=label, checkpoint=info)

    @property
    def name(self) -> str:
        return self.label or self.config.get("_name_or_path") or self.config["model_type"]

    @property
    def n_layer(self) -> int | None:
        """The blocks of the stack (``num_hidden_layers``), where the model built on the meta device has that many in
        its stack (else None: captured whole)."""
        layers = _first(self.config, LAYERS)
        sigs = self._signatures()
        return layers if isinstance(layers, int) and sigs is not None and len(sigs) == layers else None

    @property
    def layer_kinds(self) -> tuple[int, ...] | None:
        """Which blocks are alike (blocks.py), read off the model built on the meta device: DeepSeek-V3's
        (0, 0, 0, 1, 1, ...), 3 dense blocks and then MoE ones; None where its stack is not known."""
        sigs = self._signatures() if self.n_layer is not None else None
        return kinds_of(sigs) if sigs is not None else None

    @property
    def experts(self) -> Experts | None:
        """The routed experts of a Mixture-of-Experts model (total and active parameters); None for a dense one."""
        self._signatures()
        return _EXPERTS.get(json.dumps(self.config, sort_keys=True, default=str))

    def _signatures(self) -> list[tuple] | None:
        """The blocks' signatures (blocks.signatures) of the model built on the meta device, once per config (and its
        experts, ``experts``)."""
        key = json.dumps(self.config, sort_keys=True, default=str)
        if key not in _SIGNATURES:
            try:
                import transformers
            except ImportError:
                return None
            self._check_config(transformers)  # an unknown model_type is named before anything is built
            try:
                with torch.device("meta"), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    config, model = self._model(transformers, self._config_dict())
            except GpuwiseError:
                _SIGNATURES[key] = None
                return None  # the capture builds it again and says why
            blocks = find_blocks(model)
            sigs = signatures(blocks) if blocks is not None else None
            _EXPERTS[key] = experts_of(config, model)
            _CLASSES[key] = type(model)
            _SIGNATURES[key] = sigs  # kept only once built: an interrupted build is tried again
        return _SIGNATURES[key]

    @property
    def decoder(self) -> Decoder | None:
        """The KV-cache dimensions from config.json (decoder-only models: a CausalLM architecture)."""
        c = self.config
        archs = c.get("architectures") or []
        layers, heads = _first(c, LAYERS), _first(c, HEADS)
        if not (isinstance(layers, int) and isinstance(heads, int) and self.causal_lm and archs):
            return None
        kv = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or (_first(c, WIDTH) or 0) // heads
        latent = (c["kv_lora_rank"] + c["qk_rope_head_dim"]  # multi-head latent attention (Decoder's docstring)
                  if isinstance(c.get("kv_lora_rank"), int) and isinstance(c.get("qk_rope_head_dim"), int) else 0)
        return (Decoder(layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim, kv_latent=latent) if head_dim
                else None)

    @property
    def max_positions(self) -> int | None:
        for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"):
            if isinstance(self.config.get(key), int):
                return self.config[key]
        return None

    @property
    def causal_lm(self) -> bool:
        """The config names a causal LM (an LM head over a decoder), or no class (built as one)."""
        arch = next(iter(self.config.get("architectures") or []), None)
        return not isinstance(arch, str) or arch.endswith(("ForCausalLM", "LMHeadModel"))

    def attention(self, setup: Setup) -> Attention:
        """The attention implementation ``setup`` runs: --attention if given, else config.json's
        ``attn_implementation``, else what transformers picks for the class (SDPA where it has it, else eager)."""
        if setup.attention is not None:
            return setup.attention
        own = _own_attention(self.config.get("attn_implementation"))
        if own is not None and (own == "eager" or self._supports(own) is not False):
            return own
        return "eager" if self._supports("sdpa") is False else "sdpa"

    def _supports(self, attention: str) -> bool | None:
        """Whether transformers runs ``attention`` (sdpa, flash, flex) for this model (its class's flag, read off the
        model built on the meta device); None where that is not known."""
        self._signatures()
        cls = _CLASSES.get(json.dumps(self.config, sort_keys=True, default=str))
        return None if cls is None else bool(getattr(cls, _SUPPORTS[attention], False))

    def check(self, setup: Setup) -> None:
        if setup.attention == "gpuwise":
            raise GpuwiseError("--attention gpuwise (gpuwise.ops.attention) applies to the built-in GPT and Llama "
                               "models", "pass --attention eager, sdpa, flash or flex, or plan a built-in model, "
                               "e.g. --model llama3-8b --attention gpuwise")
        if setup.attention in _SUPPORTS and self._supports(setup.attention) is False:
            name = (self.config.get("architectures") or [self.config["model_type"]])[0]
            ran = "eager" if self._supports("sdpa") is False else "sdpa"
            raise GpuwiseError(f"--attention {setup.attention}: transformers' {name} does not run "
                               f"{_TRANSFORMERS_NAME[setup.attention]} ({_SUPPORTS[setup.attention]} is False)",
                               f"pass --attention {ran}, or drop --attention")
        if setup.loss != "standard" and not self.causal_lm:
            arch = (self.config.get("architectures") or [self.config["model_type"]])[0]
            raise GpuwiseError(f"--loss {setup.loss} applies to causal language models, not {arch}", "drop --loss")
        if setup.task == "decode":
            check_decode(self.name, self.causal_lm and self.decoder is not None, self.context(setup),
                          self.max_positions)
        _check_main_input(self, setup)
        kinds = self.layer_kinds if setup.pp > 1 else None
        if kinds is not None and len(set(kinds)) > 1:  # a stage would need the blocks it holds, not the first ones
            raise GpuwiseError(f"--pp {setup.pp}: {self.name}'s blocks are not all alike ({len(set(kinds))} kinds, "
                               "e.g. dense and MoE, or sliding and global attention), and the planner splits only "
                               "stacks of identical blocks into pipeline stages",
                               "drop --pp (--tp or --sharding fsdp split the model too)")
        if setup.seq is not None and self.max_positions is not None and setup.seq > self.max_positions:
            raise GpuwiseError(f"--seq {setup.seq} is longer than the config's {self.max_positions} positions",
                               f"pass --seq {self.max_positions} or less")

    def tokens(self, setup: Setup) -> int:
        if setup.task == "decode" or hf_inputs.kind(self.model_class) != hf_inputs.TOKENS:
            return 1  # an image a sample, an audio clip a sample (--seq is then its transcript's tokens: hf_audio.py)
        return setup.seq or min(2048, self.max_positions or 2048)

    @property
    def model_class(self) -> type | None:
        """The transformers class config.json names (None: built as a causal LM, or no transformers)."""
        try:
            import transformers
        except ImportError:
            return None
        arch = next(iter(self.config.get("architectures") or []), None)
        return getattr(transformers, arch, None) if isinstance(arch, str) else None

    def context(self, setup: Setup) -> int:
        """--task decode: the tokens already cached (default: the prefill's default sequence)."""
        default = min(2048, self.max_positions or 2048)
        return setup.context or (min(default, self.max_positions - 1) if self.max_positions else default)

    def _check_config(self, transformers: ModuleType) -> None:
        """An unknown model_type names the closest ones (transformers' own error lists all 800); an absurd block
        count is a typo that would build for hours."""
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        kind = self.config["model_type"]
        if kind not in CONFIG_MAPPING_NAMES:
            close = difflib.get_close_matches(str(kind), list(CONFIG_MAPPING_NAMES), n=3, cutoff=0.5)
            raise GpuwiseError(f"{self.path}: model_type {kind!r} is not one transformers {transformers.__version__} "
                               "knows", f"closest: {', '.join(close)}" if close else "check model_type")

    def _config_dict(self) -> dict:
        """config.json less its dtype (the setup decides), a deep copy: transformers' config classes edit nested dicts
        in place (DeepSeek-V3's ``rope_scaling`` gains ``rope_theta``), which would change the config's cache keys."""
        return {k: copy.deepcopy(v) for k, v in self.config.items() if k not in ("torch_dtype", "dtype")}

    def _model(self, transformers: ModuleType, cfg_dict: dict, attention: Attention | None = None
               ) -> tuple[Any, nn.Module]:
        """The config and the model transformers builds from ``cfg_dict``: the class the config names
        (BertForSequenceClassification, LlamaForCausalLM, ...), else a causal LM, with ``attention`` (None:
        config.json's own, else SDPA) built as ``_BUILT_AS`` says ("eager" keeps the s x s attention matrix, as it
        does on GPUs). A model that refuses it gets transformers' own default (``check`` refuses an explicit
        --attention such a model cannot run first)."""
        arch = next(iter(cfg_dict.get("architectures") or []), None)
        cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
        wanted = _BUILT_AS[attention or _own_attention(self.config.get("attn_implementation")) or "sdpa"]
        for attn in dict.fromkeys((wanted, None)):
            try:
                config = transformers.AutoConfig.for_model(**cfg_dict)
                if attn is not None:
                    config._attn_implementation = attn
                return config, _construct(transformers, cls, config)
            except Exception as exc:
                error = exc
        name = arch if isinstance(arch, str) else cfg_dict["model_type"]
        if isinstance(error, DataDependentOutputException):
            raise GpuwiseError(f"transformers' {name} reads a tensor's value while it is built ({error.func}: .item() "
                               "or .tolist(), say drop-path rates from torch.linspace), and the plan's fake tensors "
                               "have none", "not a config.json problem: this architecture cannot be planned on fake "
                               "tensors yet (GPUWISE_DEBUG=1 shows where it reads)") from error
        if "Couldn't swap" in str(error) or "not linked with support for cuda" in str(error).lower():
            raise GpuwiseError(f"transformers' {name} moves or converts a module with .to() while it is built "
                               f"({first_line(error)}), which the plan's fake tensors cannot do",
                               "not a config.json problem: this architecture cannot be planned on fake tensors yet "
                               "(GPUWISE_DEBUG=1 shows where)") from error
        raise GpuwiseError(f"transformers could not build {self.path}: {first_line(error)}",
                           "check model_type and the fields of config.json") from error

    def build(self, setup: Setup, batch: int, n_layer: int | None) -> Built:
        try:
            import transformers
        except ImportError:
            raise GpuwiseError("--hf-config needs transformers", 'pip install "gpuwise[hf]"') from None
        self._check_config(transformers)
        cfg_dict = self._config_dict()
        attention = self.attention(setup)
        if n_layer is not None:  # the stack's first n_layer blocks (blocks.py), checked against the real stack's
            cfg_dict = _first_blocks(cfg_dict, n_layer)
            try:
                config, model = self._model(transformers, cfg_dict, attention)
            except GpuwiseError as exc:
                raise Misaligned(f"the first {n_layer} blocks do not build: {exc.message}") from exc
            blocks = find_blocks(model)
            if blocks is None or signatures(blocks) != (self._signatures() or [])[:n_layer]:
                raise Misaligned(f"a config of {n_layer} blocks does not build the stack's first {n_layer}")
        else:
            config, model = self._model(transformers, cfg_dict, attention)
        hf_audio.every_layer(model)  # LayerDrop's draw reads a value: every layer runs (the step's worst case)
        hf_audio.spec_augment(model)  # wav2vec2's SpecAugment masks without a boolean index (hf_audio.py)
        hf_inputs.settle(model)  # X-MOD's default language (hf_inputs.py)
        top1_routers(model)  # Switch Transformer's routers (hf_build.py)
        seq = self.tokens(setup)
        decode = setup.task == "decode"
        name = type(model).__name__
        main = hf_inputs.main_input(type(model))  # input_ids, pixel_values, input_features... (hf_inputs.py)
        what, clip = hf_inputs.kind(type(model)), setup.audio_seconds
        # the labels' tokens: the inputs' own, or a speech model's transcript (--seq, else hf_audio's default)
        target = hf_audio.target_tokens(type(model), config, setup.seq, clip) if what in hf_inputs.AUDIO else seq
        ids = hf_inputs.make_input(what, config, batch, seq=seq, image=setup.image_size, dtype=setup.input_dtype,
                                   audio_seconds=clip)
        labels = hf_inputs.make_labels(model, ids, seq=target)
        # an encoder-decoder run without labels is given its decoder's inputs (T5, Whisper under --task infer)
        decoder_ids = (hf_inputs.decoder_inputs(model, batch, seq=target)
                       if labels is None or not setup.training else None)
        ctc = hf_audio.uses_ctc(model)  # its loss is computed outside: the CTC kernel reads the labels' values
        options = hf_inputs.forward_options(model, setup.image_size)  # ViT's positions interpolated to --image-size

        # Inference of a decoder fills transformers' own KV cache (a DynamicCache, one K and V per layer, each
        # (B, kv_heads, T, head_dim) for the T tokens given), as generate() does in its prefill.
        key = (json.dumps(cfg_dict, sort_keys=True, default=str), type(model).__name__)
        cached = not setup.training and self.causal_lm and _cache_runs(model, key)
        filled = None
        if decode:
            if not cached:
                raise GpuwiseError(f"{name} runs no KV cache in transformers {transformers.__version__}, so it has "
                                   "no decode step to plan", "plan --task infer")
            filled = _filled_cache(model, batch, self.context(setup))
            # transformers 5 names the argument cache (past_key_values before, deprecated since)
            cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        outside = setup.training and setup.loss != "standard"  # the loss computed outside the model
        if outside and (not isinstance(model.get_output_embeddings(), nn.Linear)
                        or getattr(model, "base_model", model) is model):
            raise GpuwiseError(f"--loss {setup.loss} needs a causal LM's linear LM head; {name} has none",
                               "drop --loss")

        def run(model, inputs, targets, kv_cache):
            kwargs = {"use_cache": cached} if getattr(model.config, "use_cache", None) is not None else {}
            if filled is not None:  # one token per sequence after the N in the cache, as generate()'s later steps
                kwargs |= {"use_cache": True, cache_kw: filled}
            with _real_masks():
                if outside and targets is not None:
                    # Liger and torchtune take the loss out of the model: the last hidden state and the LM head
                    out = model.base_model(input_ids=inputs[0], **kwargs)
                    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
                    shifted = F.pad(targets, (0, 1), value=IGNORE_INDEX)[..., 1:]  # as transformers shifts labels
                    return causal_lm_loss(setup.loss, hidden, model.get_output_embeddings(), shifted)
                if targets is not None and not ctc:
                    kwargs["labels"] = targets
                if len(inputs) > 1:
                    kwargs["decoder_input_ids"] = inputs[1]
                out = model(**{main: inputs[0]}, **options, **kwargs)
            if not setup.training:
                return out
            if targets is not None and ctc:
                return hf_audio.ctc_loss(model, out.logits, targets, inputs[0])
            if targets is not None:
                return out.loss
            # a model without labels (DeiT's with a teacher): its last hidden state, else its first output (logits)
            hidden = getattr(out, "last_hidden_state", None)
            if hidden is None and hasattr(out, "to_tuple") and out.to_tuple():
                hidden = out.to_tuple()[0]
            return scalar_loss(out if hidden is None else hidden)

        inputs = (ids,) if decoder_ids is None else (ids, decoder_ids)
        return Built(model=model, inputs=inputs, targets=labels if setup.training else None, run=run,
                     cache_tensors=_cache_tensors if cached else None,
                     kv_filled=(lambda: _cache_parts(filled)) if filled is not None else None)


_CACHE_RUNS: dict[tuple[str, str], bool] = {}
_SIGNATURES: dict[str, list[tuple] | None] = {}
_EXPERTS: dict[str, Experts | None] = {}
_CLASSES: dict[str, type] = {}  # the class transformers builds for each config (its attention flags)


def _first(config: dict, keys: tuple[str, ...]) -> int | None:
    """The first of ``keys`` config.json gives as a whole number."""
    return next((config[k] for k in keys if isinstance(config.get(k), int) and not isinstance(config[k], bool)),
                None)


def _own_attention(value: Any) -> Attention | None:
    """config.json's ``attn_implementation`` as --attention names it ("flash_attention_2", "flash_attention_3" and
    hub kernels such as "kernels-community/flash-attn" are flash; "flex_attention" flex); None: none, or one not
    known (transformers' default then)."""
    if not isinstance(value, str):
        return None
    return next((name for key, name in (("flash", "flash"), ("flex", "flex"), ("sdpa", "sdpa"), ("eager", "eager"))
                 if key in value.lower()), None)


def _construct(transformers: ModuleType, cls: type | None, config: Any) -> nn.Module:
    """The model of ``config``. Where its weight initialisation reads tensor values, which fake tensors do not have
    (torch 2.13's ``trunc_normal_``, ModernBERT's and ViT's initialiser), it is built again without initialising:
    the plan needs the weights' shapes, not their values. Tied weights are still tied (``tie_weights`` is apart)."""
    def build() -> nn.Module:
        with concrete_constants() as unreal:  # drop-path rates read off torch.linspace (hf_build.py)
            model = cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
        unreal(model)
        return model

    base = getattr(transformers, "PreTrainedModel", None)
    try:
        return build()
    except DataDependentOutputException:
        if not hasattr(base, "initialize_weights"):  # transformers 5 (4.x initialises inside init_weights)
            raise
    original = base.initialize_weights
    base.initialize_weights = lambda self: None
    try:
        return build()
    finally:
        base.initialize_weights = original


def _check_main_input(source: HFSource, setup: Setup) -> None:
    """--seq is for token models, --image-size for image ones; inputs the planner does not make are refused."""
    arch = (source.config.get("architectures") or [source.config["model_type"]])[0]
    hf_inputs.check_input(source.model_class, arch)
    kind = hf_inputs.kind(source.model_class)
    config = _config_object(source) if source.model_class is not None else None
    if config is not None and setup.training:  # T5 without decoder_start_token_id fails shifting its labels
        hf_inputs.check_decoder_start(source.model_class, config, arch)
    if kind in hf_inputs.AUDIO:  # --seq is the transcript's tokens; the clip's length is hf_audio's
        if setup.image_size is not None:
            raise GpuwiseError(f"--image-size does not apply to {arch}, which takes audio ({kind})",
                               "drop --image-size")
        if config is not None:
            hf_audio.check(source.model_class, config, arch, seq=setup.seq, audio_seconds=setup.audio_seconds)
        return
    if setup.audio_seconds is not None:
        raise GpuwiseError(f"--audio-seconds does not apply to {arch}, which takes {kind}", "drop --audio-seconds")
    if setup.image_size is not None and kind != hf_inputs.PIXELS:
        raise GpuwiseError(f"--image-size does not apply to {arch}, which takes {kind}", "use --seq")
    if setup.seq is not None and kind != hf_inputs.TOKENS:
        raise GpuwiseError(f"--seq does not apply to {arch}, which takes {kind}", "use --image-size")


def _config_object(source: HFSource) -> Any:
    """transformers' config of ``source`` (its class's defaults filled in); None where it does not build (the build
    says why)."""
    try:
        import transformers

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return transformers.AutoConfig.for_model(**source._config_dict())
    except Exception:
        return None


def _first_blocks(cfg: dict, n_layer: int) -> dict:
    """``cfg`` for the stack's first ``n_layer`` blocks: ``num_hidden_layers``, and every list with one entry a block
    (``layer_types``, ``no_rope_layers``...) or pattern string with one letter a block (Nemotron-H's
    ``hybrid_override_pattern``) cut to as many. Whether that built the first blocks, the build checks."""
    depth = next(k for k in LAYERS if _first(cfg, (k,)) is not None)  # num_hidden_layers, or GPT-2's n_layer
    full = cfg[depth]
    out = dict(cfg, **{depth: n_layer})
    for key, value in cfg.items():
        per_block = isinstance(value, list) or (isinstance(value, str) and key.endswith("pattern"))
        if per_block and len(value) == full:
            out[key] = value[:n_layer]
    return out


def _cache_runs(model: nn.Module, key: tuple[str, str]) -> bool:
    """Whether the model's cache path runs (tried once per config on one fake token): a hybrid stack captured with
    too few blocks to hold an attention layer (Jamba's, say) has no KV cache to fill, and transformers says so by
    raising. Such a model is planned without a cache, as before."""
    hit = _CACHE_RUNS.get(key)
    if hit is None:
        try:
            with torch.no_grad(), _real_masks(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True)
            hit = True
        except Exception:
            hit = False
        _CACHE_RUNS[key] = hit
    return hit


def _filled_cache(model: nn.Module, batch: int, context: int):
    """transformers' DynamicCache holding ``context`` tokens per sequence, as generate() leaves it after the prefill:
    each layer's K and V shaped as the model makes them (a probe of one token tells), filled through the cache's
    own ``update`` (a sliding-window layer keeps its window only)."""
    from transformers import DynamicCache

    with torch.no_grad(), _real_masks(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True)
    out = getattr(probe, "cache", None)  # transformers 5 (past_key_values before: reading it warns in 5)
    layers = getattr(out if out is not None else getattr(probe, "past_key_values", None), "layers", None)
    if layers is None:
        raise GpuwiseError(f"{type(model).__name__}'s cache is not a transformers DynamicCache",
                           "plan --task infer")
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(layers):
        k, v = layer.keys, layer.values
        cache.update(k.new_empty((batch, *k.shape[1:-2], context, k.shape[-1])),
                     v.new_empty((batch, *v.shape[1:-2], context, v.shape[-1])), i)
    for layer in cache.layers:  # a sliding layer keeps a view of its window; in a steady decode step, of window size
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > t.numel() * t.element_size():
                setattr(layer, name, t.clone())
    return cache


def _cache_tensors(out: Any) -> list[torch.Tensor]:
    """The key and value tensors of the cache in a transformers output (``cache`` from 5.x on, else
    ``past_key_values``): a Cache with ``layers`` (5.x), ``key_cache``/``value_cache`` lists (4.x), or tuples."""
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    return [] if cache is None else _cache_parts(cache)


def _cache_parts(cache: Any) -> list[torch.Tensor]:
    """The key and value tensors a transformers cache holds."""
    if hasattr(cache, "layers"):
        parts = [t for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]
    elif hasattr(cache, "key_cache"):
        parts = [*cache.key_cache, *cache.value_cache]
    else:
        parts = list(tree_leaves(cache))
    return [t for t in parts if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def _real_masks() -> Iterator[None]:
    """Let transformers build the attention mask a real run builds.

    Given no attention mask and no cache, transformers (masking_utils, 4.53 on) checks the position ids for packed
    sequences; a fake tensor has no values, so ``find_packed_sequence_indices`` takes it for packed (its ``is_tracing``
    counts fake tensors) and an explicit (B, 1, T, T) mask is built and kept by every layer's attention, with
    repeated K and V heads for grouped-query attention. On the GPU the ids are the ``arange`` the model makes
    itself: one sequence per row, no mask, SDPA with ``is_causal`` (and ``enable_gqa``). Answer as it does there."""
    try:
        from transformers import masking_utils
    except ImportError:
        masking_utils = None
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
