"""Every architecture transformers ships, planned (issue 17): which ones `gpuwise plan --hf-config` covers today.

For each architecture of transformers' auto mappings for causal LM, masked LM, sequence classification and image
classification, a small config of its model type (2 layers, width 64, vocabulary 1000, heads, KV heads and
intermediate sizes to match, images of 32 px; the config class's defaults for every other field, sub-configs such
as ``text_config`` and ``vision_config`` made small the same way; a field the class leaves None that published
configs set, and the few per type in ``_PUBLISHED``, given a value) is written to a temporary config.json and one
training step (bf16 autocast, AdamW, batch 2 x 32 tokens) is planned in-process, as ``gpuwise plan --hf-config``
plans it. The same model is built for real (on the meta device, else on the CPU) and its parameter count compared
with the plan's. Results: ``ok`` (the plan completes with the exact count), ``param mismatch``, ``refused`` (a
one-line GpuwiseError, as the user sees it), ``crashed`` (any other exception: our bug), ``timeout``, or
``unbuildable`` (transformers itself cannot build any config of that type: not counted).

``--memtracker`` also runs, for a sample (decoders, encoders, a vision model), the fp32 step for real on the CPU
under PyTorch's MemTracker (torch.distributed._tools.mem_tracker) and prints the planned peak over its peak.

    python benchmarks/hf_sweep.py [--task causal-lm|masked-lm|seq-cls|image-cls|all] [--only llama,bert]
        [--limit N] [--timeout S] [--json FILE] [--markdown FILE] [--memtracker]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TASKS = {  # --task: transformers' auto mapping, and the family the summary counts it in
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "decoder"),
    "masked-lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "encoder"),
    "seq-cls": ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "sequence classification"),
    "image-cls": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "vision"),
}
BATCH, SEQ, IMAGE = 2, 32, 32
LAYERS, WIDTH, HEADS, KV_HEADS, VOCAB, FFN = 2, 64, 4, 2, 1000, 128
EXPERTS, TOP_K = 4, 2

# The fields a config may call each thing by, and the value each gets where the class has it (ints only).
_INT_FIELDS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (LAYERS, ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers", "encoder_layers",
             "decoder_layers", "num_encoder_layers", "text_layers", "vision_layers", "num_self_attends_per_block")),
    (WIDTH, ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "model_dim", "word_embed_proj_dim",
            "embedding_size", "hidden_dim", "d_latents")),
    (HEADS, ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
            "decoder_attention_heads", "num_self_attention_heads", "num_cross_attention_heads")),
    (KV_HEADS, ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")),
    (WIDTH // HEADS, ("head_dim", "d_kv", "attention_head_size", "kv_channels")),
    (FFN, ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "ffn_hidden_size",
          "moe_intermediate_size", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
          "expert_ffn_hidden_size")),
    (VOCAB, ("vocab_size", "n_vocab", "vocab_size_per_layer_input", "encoder_hash_byte_group_vocab")),  # Gemma-3n, BLT
    (EXPERTS, ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts",
              "zero_expert_num")),  # LongCat-Flash: identity experts, 256 by default
    (TOP_K, ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "top_k")),
    (1, ("n_group", "topk_group", "first_k_dense_replace", "decoder_sparse_step", "num_expert_group")),
    (IMAGE, ("image_size",)),
    (WIDTH // HEADS, ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "mamba_head_dim")),  # MLA, Mamba
    (WIDTH // 2, ("kv_lora_rank", "q_lora_rank")),
    (16, ("ssm_state_size", "state_size", "d_state")),
)
_OVERRIDES = {name: value for value, names in _INT_FIELDS for name in names}
_LAYER_COUNTS = set(_INT_FIELDS[0][1])
_HEADS, _KV_HEADS, _TOP_K = _INT_FIELDS[2][1], set(_INT_FIELDS[3][1]), set(_INT_FIELDS[8][1])
_UNSET_MOE = {"num_experts_per_tok", "n_group", "topk_group"}
# Fields whose class default is None but which every published config of the type sets (the model cannot be built
# without them): given the small value where the default leaves them unset. Head sizes (Ministral, Hunyuan), routed
# experts (dots1), KV heads (Nemotron).
_UNSET = {*_UNSET_MOE, "head_dim", "n_routed_experts", "num_key_value_heads"}
# What published configs of a type set and the class's defaults lack, transformers 5.24 cannot build otherwise:
# DBRX's attention config reads rope_theta and clip_qkv (databricks/dbrx-base: 500,000 and 8), LFM2-MoE its
# layer_types (LiquidAI's configs list "conv" and "full_attention" layers; two layers of that here), dots1 its shared
# experts (rednote-hilab/dots.llm1: 2; one here), T5 the token its decoder starts from (google-t5/t5-small: 0, the
# padding token). Perceiver's masked LM decodes every one of its max_position_embeddings positions, and its labels
# are the step's tokens: as many positions as those (a tokenizer pads its inputs to 2,048). Zamba shares one
# attention block among its hybrid layers, and transformers 5.24 cannot tie it with one such layer: two of them.
_PUBLISHED: dict[str, dict[str, Any]] = {
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    "dots1": {"n_shared_experts": 1},
    "t5": {"decoder_start_token_id": 0},
    "perceiver": {"max_position_embeddings": SEQ},
    "zamba": {"layers_block_type": ["hybrid", "hybrid"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
}
_HEAD_DIMS = {"head_dim", "d_kv", "attention_head_size", "kv_channels", "qk_rope_head_dim", "qk_nope_head_dim",
              "v_head_dim", "mamba_head_dim"}
# The configs tried in turn until transformers builds one and runs a step of it on the CPU: the small one; the same
# with the head sizes the class derives; without the layer counts and per-layer patterns; the class's defaults.
LEVELS = ("small", "small, derived head sizes", "small width, default layers", "class defaults")
# per-layer patterns (lists, or strings of one character a layer): two layers of it, as unlike each other as it has
_PATTERNS = ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern", "layers_block_types",
             "attn_layer_indices", "mlp_only_layers")


@dataclass
class Row:
    architecture: str
    model_type: str
    task: str
    result: str = ""  # ok, param mismatch, refused, crashed, timeout, unbuildable
    plan_params: int | None = None
    real_params: int | None = None
    reason: str = ""
    level: int = 0  # the config built: LEVELS[level]
    seconds: float = 0.0


class Timeout(BaseException):  # not an Exception: transformers' and gpuwise's `except Exception` let it through
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise Timeout in the main thread after ``seconds`` (no limit where SIGALRM does not exist)."""
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def fire(signum, frame):
        raise Timeout(f"over {seconds:g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def architectures(task: str = "all", only: set[str] | None = None) -> list[tuple[str, str, str]]:
    """(task, model_type, architecture) for every entry of the auto mappings of ``task``."""
    from transformers.models.auto import modeling_auto

    out = []
    for name in TASKS if task == "all" else [task]:
        mapping = getattr(modeling_auto, TASKS[name][0])
        for model_type, arch in mapping.items():
            for a in (arch,) if isinstance(arch, str) else tuple(arch):
                if only is None or model_type in only:
                    out.append((name, model_type, a))
    return out


def _pattern(value: Any) -> Any:
    """Two layers of a per-layer pattern: the first, and the first unlike it (else the first twice)."""
    items = list(value)
    if len(items) <= LAYERS:
        return value
    second = next((x for x in items[1:] if x != items[0]), items[1])
    picked = [items[0], second]
    return "".join(picked) if isinstance(value, str) else picked


def _shrink(config: Any, level: int) -> dict:
    """The overrides for one config object (a PretrainedConfig), its sub-configs' included."""
    from transformers import PretrainedConfig

    values = config.to_dict()
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, bool):
            continue
        if value is None and key in _UNSET and level < 3:  # DeepSeek-V2's defaults leave its routing unset
            if level == 1 and key in _HEAD_DIMS:
                continue
            out[key] = _OVERRIDES[key]
            continue
        if key.endswith("_token_id") and isinstance(value, int) and value >= VOCAB and not any(
                m in key for m in ("image", "video", "audio", "vision")):  # special tokens within the vocabulary
            out[key] = 0 if key == "pad_token_id" else VOCAB - 1
        elif key == "rotary_dim" and isinstance(value, int):  # GPT-J, CodeGen: rotary dims within a head
            out[key] = WIDTH // HEADS
        elif key in _OVERRIDES and isinstance(value, int):
            if level == 1 and key in _HEAD_DIMS:
                continue
            if level == 2 and (key in _LAYER_COUNTS or key in ("first_k_dense_replace", "decoder_sparse_step")):
                continue
            want = _OVERRIDES[key]
            if key in _TOP_K and value == 1:  # a top-1 router stays top-1 (ZAYA takes no other)
                continue
            if key in _KV_HEADS:  # multi-head attention stays multi-head (MLA needs it), multi-query stays so
                heads = next((values[k] for k in _HEADS if isinstance(values.get(k), int)), None)
                want = 1 if value == 1 else HEADS if heads is not None and value >= heads else KV_HEADS
            if key in ("n_group", "topk_group", "first_k_dense_replace", "decoder_sparse_step", "num_expert_group") \
                    and value == 0:
                continue
            if key in _LAYER_COUNTS and value < LAYERS:
                continue
            out[key] = want
        elif level < 2 and key in _OVERRIDES and isinstance(value, list) and value \
                and all(isinstance(v, int) and not isinstance(v, bool) for v in value):  # per layer (Gemma-3n's FFN)
            out[key] = [_OVERRIDES[key]] * LAYERS
        elif level < 2 and key in _PATTERNS and isinstance(value, (list, str)) and value:
            out[key] = _pattern(value)
        elif level < 2 and key == "depths" and isinstance(value, list):
            out[key] = [1] * len(value)
        elif key == "hidden_sizes" and isinstance(value, list) and all(isinstance(v, int) for v in value):
            out[key] = [max(8, min(v // 8, WIDTH)) for v in value]
        elif key == "num_heads" and isinstance(value, list):  # Swin-like: heads per stage, of an embed_dim of 64
            out[key] = [min(HEADS, 2**i) for i in range(len(value))]
    if "head_dim" in out and "hidden_size" not in values and "d_model" not in values:
        del out["head_dim"]
    # Mamba-2: heads x head size = expand x width
    if isinstance(values.get("expand"), int) and "mamba_num_heads" in values:
        out["mamba_num_heads"] = values["expand"] * WIDTH // out.get("mamba_head_dim", values.get("mamba_head_dim", 1))
    elif isinstance(values.get("expand"), int) and "num_heads" in values and "head_dim" in values:
        out["num_heads"] = values["expand"] * WIDTH // out.get("head_dim", values["head_dim"])
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            out[key] = {"model_type": sub.model_type, **_shrink(sub, level)} if sub.model_type else _shrink(sub, level)
    return out


def small_config(model_type: str, architecture: str, level: int = 0) -> dict:
    """config.json of a small ``model_type`` model of class ``architecture`` (``LEVELS[level]``). A sequence
    classifier gets a padding token where its config has none, as a fine-tuning config does (transformers'
    classifiers find each sequence's last token by it and refuse a batch above 1 without one)."""
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]()
    overrides = _shrink(defaults, level) if level < 3 else {}
    for key, value in _PUBLISHED.get(model_type, {}).items():
        overrides[key] = {**overrides.get(key, {}), **value} if isinstance(value, dict) else value
    if architecture.endswith("ForSequenceClassification"):
        if getattr(defaults, "pad_token_id", 0) is None:
            overrides["pad_token_id"] = 0
        for key in getattr(defaults, "sub_configs", {}) or {}:  # Qwen3.5's classifier reads its text config's
            sub = getattr(defaults, key, None)
            if sub is defaults.get_text_config() and getattr(sub, "pad_token_id", 0) is None:
                overrides[key] = {**overrides.get(key, {}), "pad_token_id": 0}
    return {"model_type": model_type, "architectures": [architecture], **overrides}


def build_real(config: dict, *, device: str = "meta"):
    """The model transformers builds from ``config`` (SDPA where it takes it), on ``device``."""
    import torch
    import transformers

    from gpuwise.planning.sources.hf_inputs import settle

    cfg = {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")}
    cls = getattr(transformers, config["architectures"][0])
    error: Exception | None = None
    for attn in ("sdpa", None):
        try:
            conf = transformers.AutoConfig.for_model(**cfg)
            if attn is not None:
                conf._attn_implementation = attn
            with torch.device(device):
                model = cls(conf)
            settle(model)  # a default language for X-MOD, as the plan sets it
            return model
        except Exception as exc:
            error = exc
    assert error is not None
    raise error


def real_inputs(model, task: str, *, labels: bool = True) -> dict:
    """The inputs of one step of ``model`` (batch 2 x 32 tokens, or 32 px images), with labels for its loss."""
    import torch

    from gpuwise.planning.sources.hf_inputs import _token_ids

    conf = model.config
    if task == "image-cls":
        vision = getattr(conf, "vision_config", conf)
        inputs = {"pixel_values": torch.randn(BATCH, getattr(vision, "num_channels", 3), IMAGE, IMAGE)}
    else:
        vocab = getattr(conf, "vocab_size", None) or getattr(conf.get_text_config(), "vocab_size", None) or VOCAB
        # the plan's token ids: random, each row ending with the end-of-sequence token (hf_inputs._token_ids)
        inputs = {"input_ids": _token_ids(int(vocab), BATCH, SEQ, getattr(conf, "eos_token_id", None))}
        if getattr(conf, "use_cache", None) is not None:
            inputs["use_cache"] = False
    if labels:
        classes = max(int(getattr(conf, "num_labels", 2)), 1)
        inputs["labels"] = (torch.randint(classes, (BATCH,)) if task in ("seq-cls", "image-cls")
                            else inputs["input_ids"])
    return inputs


def real_params(config: dict, task: str, *, run: bool = True) -> int:
    """Parameters of the model transformers builds from ``config``; ``run``: built on the CPU, and one forward
    of it run there (a config that builds but cannot run is no test of the planner). Else on the meta device."""
    import torch

    from gpuwise.planning.sources.hf import _real_masks

    model = build_real(config, device="cpu" if run else "meta")
    if run:
        with torch.no_grad(), _real_masks():
            model(**real_inputs(model, task, labels=False))
    return sum(p.numel() for p in model.parameters())


def plan_config(config: dict, *, precision: str = "bf16-mixed", folder: Path | None = None):
    """``gpuwise plan --hf-config`` of ``config`` in-process: batch 2 x 32 tokens (or the config's images), one
    training step."""
    import transformers

    from gpuwise.planning import Setup, plan_model
    from gpuwise.planning.sources.hf_inputs import TOKENS, kind

    tokens = kind(getattr(transformers, config["architectures"][0], None)) == TOKENS  # ImageGPT's are
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(config))
        return plan_model(None, Setup(micro_batch=BATCH, seq=SEQ if tokens else None, precision=precision),
                          hf_config=str(path), gpu="h100")


def _reason(exc: BaseException, architecture: str, model_type: str = "") -> str:
    """The error's first line (a GpuwiseError's message, without its hint), with the names that differ from one
    architecture to the next taken out, so that the same failure groups as one reason."""
    from gpuwise.errors import GpuwiseError, first_line

    if isinstance(exc, Timeout):
        return f"timeout: {exc}"
    text = exc.message.strip().splitlines()[0] if isinstance(exc, GpuwiseError) else first_line(exc)
    text = re.sub(r"\S*/config\.json", "config.json", text)  # the temporary folder's name
    text = re.sub(r"0x[0-9a-f]+", "0x..", text)
    text = text.replace(architecture, "{arch}")
    return re.sub(rf"\b{re.escape(model_type)}\b", "{type}", text) if model_type else text


def sweep_one(task: str, model_type: str, architecture: str, *, timeout: float = 60.0) -> Row:
    """Build ``architecture`` for real (the smallest config transformers takes), plan it, compare the counts."""
    from gpuwise.errors import GpuwiseError

    row = Row(architecture=architecture, model_type=model_type, task=task)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with time_limit(timeout):
                config, error = None, None
                for level in range(len(LEVELS)):
                    try:
                        candidate = small_config(model_type, architecture, level)
                        row.real_params = real_params(candidate, task, run=level < len(LEVELS) - 1)
                        config, row.level = candidate, level
                        break
                    except Exception as exc:
                        error = exc
                if config is None:
                    row.result, row.reason = "unbuildable", _reason(error, architecture, model_type)
                else:
                    try:
                        p = plan_config(config)
                        row.plan_params = p.params
                        row.result = "ok" if p.params == row.real_params else "param mismatch"
                    except GpuwiseError as exc:
                        row.result, row.reason = "refused", _reason(exc, architecture, model_type)
                    except Exception as exc:
                        row.result, row.reason = "crashed", _reason(exc, architecture, model_type)
        except Timeout as exc:
            row.result, row.reason = "timeout", _reason(exc, architecture, model_type)
    row.seconds = round(time.perf_counter() - start, 2)
    return row


# --- the planned peak against PyTorch's MemTracker on the same step run for real ----------------------------

MEMTRACKER_SAMPLE = (  # (task, model_type): decoders, hybrid state-space decoders, encoders, a vision model
    ("causal-lm", "llama"), ("causal-lm", "gpt2"), ("causal-lm", "qwen2"), ("causal-lm", "mamba2"),
    ("causal-lm", "bamba"), ("causal-lm", "falcon_h1"), ("causal-lm", "nemotron_h"), ("causal-lm", "granitemoehybrid"),
    ("masked-lm", "bert"), ("seq-cls", "distilbert"), ("image-cls", "vit"),
)


def memtracker_peak(config: dict, task: str) -> int:
    """The peak of one fp32 AdamW step (forward, backward, optimizer step, its state already made) of ``config``
    run for real on the CPU, as PyTorch's MemTracker counts it."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from gpuwise.optim import param_groups
    from gpuwise.planning.sources.hf import _real_masks

    torch.manual_seed(0)
    model = build_real(config, device="cpu").train()
    inputs = real_inputs(model, task)
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-4, foreach=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    mt = MemTracker()
    mt.track_external(model, opt)
    with mt, _real_masks():
        model(**inputs).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return int(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def memtracker_check(task: str, model_type: str, *, timeout: float = 120.0) -> dict:
    """The fp32 plan's peak and MemTracker's for the first architecture of ``model_type`` under ``task``."""
    arch = next(a for t, m, a in architectures(task, {model_type}) if t == task)
    config = small_config(model_type, arch)
    out: dict[str, Any] = {"architecture": arch, "task": task, "planned": None, "measured": None, "ratio": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with time_limit(timeout):
                out["measured"] = memtracker_peak(config, task)
                out["planned"] = plan_config(config, precision="fp32").peak_bytes
                out["ratio"] = round(out["planned"] / out["measured"], 4)
        except (Exception, Timeout) as exc:
            out["reason"] = _reason(exc, arch, model_type)
    return out


# --- reports --------------------------------------------------------------------------------------------------

def summary(rows: list[Row]) -> list[dict]:
    """Per task: architectures transformers builds, how many plan with the exact count, and the other results."""
    out = []
    for task, (_, family) in TASKS.items():
        mine = [r for r in rows if r.task == task]
        if not mine:
            continue
        counts = Counter(r.result for r in mine)
        buildable = len(mine) - counts["unbuildable"]
        out.append({"task": task, "family": family, "architectures": len(mine), "buildable": buildable,
                    "ok": counts["ok"], "ok_percent": round(100 * counts["ok"] / buildable, 1) if buildable else 0.0,
                    **{k: counts[k] for k in ("param mismatch", "refused", "crashed", "timeout", "unbuildable")}})
    return out


def reasons(rows: list[Row]) -> list[tuple[str, int, list[str]]]:
    """The failures grouped by reason: (reason, count, model types), most frequent first."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        if r.result not in ("ok",):
            key = r.reason or r.result
            if r.result == "param mismatch":
                key = "param mismatch"
            groups.setdefault(f"{r.result}: {key}" if r.result != "param mismatch" else key, []).append(
                f"{r.model_type}/{r.task}")
    return sorted(((k, len(v), v) for k, v in groups.items()), key=lambda t: (-t[1], t[0]))


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[Row], checks: list[dict] | None = None) -> str:
    lines = ["| architecture | model_type | task | result | plan params | real params | reason |",
             "|---|---|---|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.architecture} | {r.model_type} | {r.task} | {r.result} | "
                     f"{'' if r.plan_params is None else f'{r.plan_params:,}'} | "
                     f"{'' if r.real_params is None else f'{r.real_params:,}'} | {_cell(r.reason[:160])} |")
    lines += ["", "| task | family | architectures | transformers builds | ok (exact count) | param mismatch | "
              "refused | crashed | timeout |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary(rows):
        lines.append(f"| {s['task']} | {s['family']} | {s['architectures']} | {s['buildable']} | {s['ok']} "
                     f"({s['ok_percent']}%) | {s['param mismatch']} | {s['refused']} | {s['crashed']} | "
                     f"{s['timeout']} |")
    lines += ["", "| count | reason | model types |", "|---:|---|---|"]
    for reason, n, who in reasons(rows):
        lines.append(f"| {n} | {_cell(reason[:200])} | {', '.join(who)} |")
    if checks:
        lines += ["", "| architecture | task | planned peak (B) | MemTracker peak (B) | ratio |",
                  "|---|---|---:|---:|---:|"]
        for c in checks:
            lines.append(f"| {c['architecture']} | {c['task']} | {c['planned'] or ''} | {c['measured'] or ''} | "
                         f"{c['ratio'] or _cell(c.get('reason', ''))} |")
    return "\n".join(lines)


def _machine() -> str:
    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = "?"
    import gpuwise

    where = Path(gpuwise.__file__).resolve().parents[1]
    here = Path(__file__).resolve().parents[1] / "src"
    source = f"gpuwise at {commit or '?'}" if where == here else f"gpuwise from {where} (not this checkout's src)"
    return (f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch "
            f"{torch.__version__}, transformers {transformers.__version__}, {source}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="all", choices=[*TASKS, "all"])
    ap.add_argument("--only", help="model types, comma-separated (llama,bert)")
    ap.add_argument("--limit", type=int, help="the first N architectures only")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per architecture [60]")
    ap.add_argument("--json", type=Path, help="write the rows, summary and reasons here")
    ap.add_argument("--markdown", type=Path, help="write the markdown tables here too")
    ap.add_argument("--memtracker", action="store_true", help="the planned peak against MemTracker for a sample")
    ap.add_argument("--quiet", action="store_true", help="no progress line per architecture")
    args = ap.parse_args(argv)
    os.environ.setdefault("GPUWISE_CACHE", "off")  # every plan captured now, not read back from an earlier run

    import transformers

    transformers.logging.set_verbosity_error()
    only = set(args.only.split(",")) if args.only else None
    todo = architectures(args.task, only)[: args.limit]
    print(f"# {len(todo)} architectures; {_machine()}", file=sys.stderr)
    rows = []
    for i, (task, model_type, arch) in enumerate(todo, 1):
        row = sweep_one(task, model_type, arch, timeout=args.timeout)
        rows.append(row)
        if not args.quiet:
            print(f"[{i}/{len(todo)}] {task} {arch}: {row.result} {row.plan_params} vs {row.real_params} "
                  f"({row.seconds:.1f} s) {row.reason[:120]}", file=sys.stderr, flush=True)
        if args.json:  # as it goes: a long sweep that is stopped keeps what it did
            args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows]}, indent=1))
    checks = None
    if args.memtracker:
        checks = []
        for task, model_type in MEMTRACKER_SAMPLE:
            if args.task in ("all", task) and (only is None or model_type in only):
                checks.append(memtracker_check(task, model_type, timeout=max(args.timeout, 120)))
                print(f"memtracker {checks[-1]}", file=sys.stderr, flush=True)
    text = markdown(rows, checks)
    print(text)
    if args.markdown:
        args.markdown.write_text(f"Machine: {_machine()}\n\n{text}\n")
    if args.json:
        args.json.write_text(json.dumps({"machine": _machine(), "rows": [asdict(r) for r in rows],
                                         "summary": summary(rows),
                                         "reasons": [{"reason": k, "count": n, "model_types": v}
                                                     for k, n, v in reasons(rows)],
                                         "memtracker": checks}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
