"""config.json as the planner reads it: as transformers reads it (bare Infinity, its float tags), no deeper than a
config nests, every size a whole number from 1, and what ``from_pretrained`` fills in where it says nothing (the
default depth and sizes, the class a config without ``architectures`` is built as)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError
from gpuwise.files import load_json

LAYERS, HEADS, WIDTH = ("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"), ("hidden_size", "n_embd")


def read_config(path: Path) -> Any:
    """config.json as transformers reads it (``PretrainedConfig._dict_from_json_file``): JSON with bare ``Infinity``
    and ``NaN``, and the ``{"__float__": "Infinity"}`` tags transformers writes for them (Mamba-2's
    ``time_step_limit``), read by ``load_json`` (no deeper than a config nests: ``TooDeep``). Without transformers,
    plain JSON: nothing is built then, and the build says why."""
    config = load_json(path.read_text(encoding="utf-8"))
    try:
        from transformers import PretrainedConfig
    except ImportError:
        return config
    decode = getattr(PretrainedConfig, "_decode_special_floats", None)  # transformers 5 (json reads them before)
    return decode(config) if decode is not None else config


# The sizes transformers builds tensors and loops from: each a whole number of at least 1 where config.json gives it
# as a number or a string (null is transformers' "unset"; a list or a mapping is one a stage or a layer, SegFormer's
# heads, Gemma-3n's widths); 0 blocks planned a model without a stack, -1 hidden size failed deep in torch
_SIZES = (*LAYERS, *HEADS, *WIDTH, "vocab_size", "num_key_value_heads", "d_model", "intermediate_size")
# What transformers' config class fills in where config.json says nothing, read for the planner as from_pretrained
# gives it: the depth a missing num_hidden_layers means (without it the stack was captured whole, minutes for a 7B
# model; with it, its first blocks), the heads and width the KV cache is sized from, the vocabulary
_DEFAULTED = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "vocab_size")
# transformers' mappings of the language-model heads a checkpoint of each model_type is saved as, besides the causal
# LM (modeling_auto.py): a model_type in the causal mapping and none of these is a decoder-only LM. An image model
# is saved as its bare model (CLIPModel) as often as with a classifier: not told from its model_type
_OTHER_HEADS = ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
                "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "MODEL_FOR_CTC_MAPPING_NAMES",
                "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES")


def check_sizes(path: Path, config: dict) -> None:
    """Every size in ``_SIZES`` config.json (or one of its ``*_config`` sub-configs) gives is a whole number >= 1,
    else one line naming the key and the value."""
    scopes = [("", config), *((f"{k}.", v) for k, v in config.items() if k.endswith("_config") and isinstance(v, dict))]
    for prefix, scope in scopes:
        for key in _SIZES:
            value = scope.get(key)
            if value is None or isinstance(value, (list, dict)) or (
                    isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                continue
            raise GpuwiseError(f"{path}: {prefix}{key} {json.dumps(value)[:60]} is not a whole number of at least 1",
                               f"fix {prefix}{key} in config.json, or drop it for transformers' default")


def as_transformers_reads(path: Path, config: dict) -> dict:
    """``config`` with what ``from_pretrained`` would make of it where config.json leaves it out: the ``_DEFAULTED``
    sizes from transformers' config class (GPT-2's under its own names, ``n_layer``...), and ``architectures`` from
    the model_type (``_architecture``). Unchanged without transformers, or for a model_type or values it does not take
    (the build says why)."""
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return config
    if config["model_type"] not in CONFIG_MAPPING_NAMES:
        return config
    out = dict(config)
    if not config.get("architectures"):
        out["architectures"] = [_architecture(path, config["model_type"])]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            full = transformers.AutoConfig.for_model(
                **{k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")})
    except Exception:
        return out
    names = getattr(full, "attribute_map", None) or {}
    for name in _DEFAULTED:
        key = names.get(name, name)  # GPT-2 keeps num_hidden_layers as n_layer
        value = getattr(full, key, None)
        if name not in config and key not in config and isinstance(value, int) and not isinstance(value, bool) \
                and value >= 1:
            out[key] = value
    return out


def _architecture(path: Path, model_type: str) -> str:
    """The class a config.json without ``architectures`` is built as, from its model_type by transformers' own
    mappings: a decoder-only LM's causal LM (Llama's LlamaForCausalLM, as AutoModelForCausalLM builds it), or the one
    class its model_type has among the heads of ``_OTHER_HEADS`` (T5's T5ForConditionalGeneration). A model_type saved
    as several (BERT: masked LM or causal LM), or as none of them (ViT), cannot be told: one line asking for
    ``architectures``."""
    from transformers.models.auto import modeling_auto

    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    others = [getattr(modeling_auto, m, {}).get(model_type) for m in _OTHER_HEADS]
    # the causal LM last, for the example: a BERT is seldom saved as BertLMHeadModel
    heads = list(dict.fromkeys(c for c in (*others, causal) if isinstance(c, str)))
    if len(heads) == 1:
        return heads[0]
    hint = "add the class the checkpoint was saved as to config.json, e.g. "
    if not heads:
        raise GpuwiseError(f"{path} has no architectures, and model_type {model_type!r} has no language-model head "
                           "in transformers to build it as",
                           hint + f'"architectures": ["{modeling_auto.MODEL_MAPPING_NAMES.get(model_type, "...")}"]')
    raise GpuwiseError(f"{path} has no architectures, and transformers builds model_type {model_type!r} as one of "
                       f"{', '.join(heads[:4])}", hint + f'"architectures": ["{heads[0]}"]')
