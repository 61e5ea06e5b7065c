"""A checkpoint's weights as stored: the dtypes and quantisation read off its files (safetensors headers, GGUF tensor
types, config.json's ``quantization_config``), so ``--weights`` is known, not assumed. No tensor is loaded.

A safetensors file opens with its header: 8 bytes, a little-endian u64 ``N``, then ``N`` bytes of JSON giving each
tensor's dtype, shape and byte range (https://github.com/huggingface/safetensors, "Format"). A GGUF file lists each
tensor's ggml type and shape before the data (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), read with
the ``gguf`` package (extra ``gpuwise[gguf]``).

>>> Quantization(method="gptq", bits=4, group_size=128).weights
'int4'
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpuwise.errors import GpuwiseError
from gpuwise.files import TooDeep, load_json
from gpuwise.planning.setup import Setup, Weights
from gpuwise.units import human_bytes

_MAX_HEADER_BYTES = 100 << 20  # safetensors refuses headers over 100 MB (its MAX_HEADER_SIZE)
# tensors a quantised layer stores beside its packed weights: scales, zero points, the GPTQ act-order permutation,
# bitsandbytes' absmax, quant map and serialised quant state, LLM.int8's row scales, fp8 scales. Bytes, not weights.
_OVERHEAD = (".scales", ".qzeros", ".g_idx", ".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".SCB",
             ".weight_format", ".weight_scale", ".weight_scale_inv", ".input_scale", ".weight_zero_point",
             ".weight_g_idx", ".weight_shape")
# GGUF mixes up to this many bits a weight are planned as int4, up to the next bound as int8 (the formats
# transforms/quantize.py lays out); above it, 16-bit floats, planned as computed
_INT4_BELOW_BITS, _INT8_BELOW_BITS = 6.0, 12.0


@dataclass(frozen=True, kw_only=True)
class Quantization:
    """config.json's ``quantization_config`` as the loaders read it: the method, the weight bits and the group."""

    method: str  # quant_method: gptq, awq, bitsandbytes, fp8, compressed-tensors, ...
    bits: int | None = None
    group_size: int | None = None  # weights sharing a scale; None: per channel or per tensor
    detail: str = ""  # bitsandbytes' nf4 or fp4, compressed-tensors' int or float

    @property
    def weights(self) -> Weights | None:
        """The --weights it is planned as (transforms/quantize.py's formats); None: none of them."""
        if self.method == "bitsandbytes":
            return {4: "nf4", 8: "int8"}.get(self.bits or 0)  # type: ignore[return-value]
        if self.method in ("fp8", "fbgemm_fp8") or (self.detail == "float" and self.bits == 8):
            return "fp8"
        if self.method in ("gptq", "awq", "compressed-tensors", "autoround", "quark"):
            return {4: "int4", 8: "int8"}.get(self.bits or 0)  # type: ignore[return-value]
        return None

    def describe(self) -> str:
        """``GPTQ 4-bit, group 128``."""
        what = {"bitsandbytes": "bitsandbytes", "fp8": "fp8"}.get(self.method, self.method.upper() if
                                                                   len(self.method) <= 5 else self.method)
        bits = f" {self.detail}" if self.method == "bitsandbytes" and self.detail else (
            f" {self.bits}-bit" if self.bits else "")
        group = f", group {self.group_size}" if self.group_size and self.group_size > 0 else ""
        return f"{what}{bits}{group}"


@dataclass(frozen=True, kw_only=True)
class Stored:
    """One dtype's share of a checkpoint: as the file names it (safetensors' ``BF16``, ``I32``; GGUF's ``Q4_K``)."""

    dtype: str
    tensors: int
    params: int  # weights it holds: a 4-bit GPTQ int32 holds eight; a scale or zero point none
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """The weights of a checkpoint as stored: each dtype's tensors, weights and bytes, and the quantisation its
    config.json names. ``stored`` is empty where only config.json is at hand (a Hub id whose weights are not cached).

    >>> info = CheckpointInfo(files=(), format="gguf", stored=(Stored(dtype="Q8_0", tensors=1, params=32, nbytes=34),))
    >>> info.bits_per_weight, info.weights
    (8.5, 'int8')
    """

    files: tuple[Path, ...]
    format: str  # safetensors, gguf, or config (config.json's quantization_config alone)
    stored: tuple[Stored, ...]  # largest share first
    quantization: Quantization | None = None
    mix: str | None = None  # GGUF's general.file_type: Q4_K_M

    @property
    def params(self) -> int:
        return sum(s.params for s in self.stored)

    @property
    def weight_bytes(self) -> int:
        """The bytes of every tensor the files hold: what a loader reads from disk."""
        return sum(s.nbytes for s in self.stored)

    @property
    def bits_per_weight(self) -> float | None:
        """8 x bytes / weights over the whole checkpoint (scales and unquantised embeddings included); None where the
        files were not read."""
        return 8 * self.weight_bytes / self.params if self.params else None

    @property
    def quantized(self) -> bool:
        if self.quantization is not None:
            return True
        bits = self.bits_per_weight
        return self.format == "gguf" and bits is not None and bits < _INT8_BELOW_BITS

    @property
    def weights(self) -> Weights | None:
        """The --weights a plan of this checkpoint uses when none is given: its quantisation's format, a GGUF mix's
        nearest (int4 under 6 bits a weight, int8 under 12); None: 16- or 32-bit floats, planned as computed, or a
        quantisation gpuwise does not lay out."""
        if self.quantization is not None:
            return self.quantization.weights
        bits = self.bits_per_weight
        if self.format != "gguf" or bits is None:
            return None
        return "int4" if bits < _INT4_BELOW_BITS else "int8" if bits < _INT8_BELOW_BITS else None

    def describe(self) -> str:
        """``4.85 bits/weight (Q4_K_M mix: Q4_K 79%, Q6_K 17%, F32 4%), 4.6 GiB``."""
        parts = []
        if self.quantization is not None:
            parts.append(self.quantization.describe())
        if self.stored:
            total = self.params or 1
            shares = ", ".join(f"{s.dtype} {100 * s.params / total:.0f}%" for s in self.stored[:4] if s.params)
            label = f"{self.mix} mix: " if self.mix else ""
            parts.append(f"{label}{shares}")
        bits = self.bits_per_weight
        if bits is None:  # config.json alone: its quantization_config
            return "; ".join(parts) or "not read"
        return f"{bits:.2f} bits/weight ({'; '.join(parts)}), {human_bytes(self.weight_bytes)}"


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Each tensor's ``{"dtype", "shape", "data_offsets"}`` from a safetensors file's JSON header (the 8-byte length,
    then the JSON); the tensors themselves are never read."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise GpuwiseError(f"{path} is not a safetensors file (shorter than its 8-byte header length)",
                                   "pass a .safetensors file written by safetensors (save_file, save_pretrained)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER_BYTES:
                raise GpuwiseError(f"{path} is not a safetensors file (a header of {n:,} bytes)",
                                   "pass a .safetensors file written by safetensors (save_file, save_pretrained)")
            header = load_json(f.read(n))
    except OSError as exc:
        raise GpuwiseError(f"cannot read {path}: {exc.strerror or exc}", "pass a readable .safetensors file") from None
    except TooDeep as exc:
        raise GpuwiseError(f"{path} is not a safetensors file (its header is {exc})",
                           "pass a .safetensors file written by safetensors (save_file, save_pretrained)") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise GpuwiseError(f"{path} is not a safetensors file (its header is not JSON)",
                           "pass a .safetensors file written by safetensors (save_file, save_pretrained)") from None
    if not isinstance(header, dict):
        raise GpuwiseError(f"{path} is not a safetensors file (its header is not a JSON object)",
                           "pass a .safetensors file written by safetensors")
    header.pop("__metadata__", None)
    return header


def _weights_in(name: str, dtype: str, numel: int, quant: Quantization | None) -> int:
    """The weights one stored tensor holds: a packed int32 ``qweight`` (GPTQ, AWQ) 32 / bits of them an element,
    bitsandbytes' 4-bit ``uint8`` weight two a byte, a scale or zero point (``_OVERHEAD``) none."""
    if name.endswith(_OVERHEAD) or ".quant_state." in name:
        return 0
    if name.endswith(".qweight") or name.endswith(".weight_packed"):  # GPTQ/AWQ; compressed-tensors' pack_quantized
        return numel * (32 // (quant.bits if quant is not None and quant.bits else 4))
    if dtype == "U8" and quant is not None and quant.method == "bitsandbytes" and quant.bits == 4:
        return numel * 2
    return numel


def _summarise(rows: Iterable[tuple[str, int, int, int]]) -> tuple[Stored, ...]:
    """(dtype, tensors, params, bytes) rows -> one Stored a dtype, the largest share (bytes) first."""
    acc: dict[str, list[int]] = {}
    for dtype, tensors, params, nbytes in rows:
        a = acc.setdefault(dtype, [0, 0, 0])
        a[0], a[1], a[2] = a[0] + tensors, a[1] + params, a[2] + nbytes
    return tuple(sorted((Stored(dtype=d, tensors=t, params=p, nbytes=b) for d, (t, p, b) in acc.items()),
                        key=lambda s: (-s.nbytes, s.dtype)))


def read_safetensors(files: Iterable[Path], quant: Quantization | None = None) -> tuple[Stored, ...]:
    """Each dtype's tensors, weights and bytes over ``files`` (one checkpoint's shards)."""
    rows = []
    for path in files:
        for name, t in read_safetensors_header(path).items():
            try:
                start, end = t["data_offsets"]
                numel = math.prod(t["shape"])
                rows.append((t["dtype"], 1, _weights_in(name, t["dtype"], numel, quant), end - start))
            except (KeyError, TypeError, ValueError):  # an entry that is no tensor's dtype, shape and byte range
                raise GpuwiseError(f"{path} is not a safetensors file (its header's {name!r} is {t!r:.80})",
                                   "pass a .safetensors file written by safetensors (save_file, save_pretrained)"
                                   ) from None
    return _summarise(rows)


def _gguf():
    try:
        import gguf
    except ImportError:
        raise GpuwiseError("reading a .gguf file needs the gguf package",
                           "install gguf: pip install 'gpuwise[gguf]'") from None
    return gguf


def read_gguf(path: Path) -> CheckpointInfo:
    """A GGUF file's tensors by ggml type (their exact bytes: blocks of a quantised type hold a fixed number of
    weights in a fixed number of bytes, ``gguf.GGML_QUANT_SIZES``) and its ``general.file_type`` (Q4_K_M)."""
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise GpuwiseError(f"{path} is not a GGUF file the gguf package reads: {exc}",
                           "pass a .gguf file written by llama.cpp's converters (or gguf.GGUFWriter)") from None
    rows = [(t.tensor_type.name, 1, int(t.n_elements), int(t.n_bytes)) for t in reader.tensors]
    mix = None
    field = reader.fields.get("general.file_type")
    if field is not None:
        try:
            mix = gguf.LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except (ValueError, TypeError):
            mix = None
    return CheckpointInfo(files=(path,), format="gguf", stored=_summarise(rows), mix=mix)


def gguf_config(path: Path) -> dict:
    """The transformers config of a GGUF file's architecture (transformers' ``load_gguf_checkpoint`` maps llama.cpp's
    metadata, ``llama.block_count`` and the rest, to config.json's keys); no tensor is read."""
    _gguf()
    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError:
        raise GpuwiseError("planning a .gguf file builds its model with transformers",
                           "pip install 'gpuwise[hf]'") from None
    try:
        config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    except (ValueError, KeyError) as exc:
        raise GpuwiseError(f"transformers cannot read the architecture of {path}: {exc}",
                           "pass the model's config.json with --hf-config instead") from None
    # numpy scalars from the metadata (rms_norm_eps) as the plain numbers config.json holds
    return json.loads(json.dumps(config, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def quantization_of(config: Mapping[str, Any]) -> Quantization | None:
    """config.json's ``quantization_config``: bitsandbytes (``load_in_4bit``/``load_in_8bit``, nf4 or fp4), GPTQ and
    AWQ (``bits``/``w_bit``, ``group_size``/``q_group_size``), fp8, compressed-tensors (its first group's weights)."""
    q = config.get("quantization_config")
    if not isinstance(q, Mapping):
        return None
    method = str(q.get("quant_method") or "").lower()
    if method == "bitsandbytes" or "load_in_4bit" in q or "_load_in_4bit" in q:
        four = bool(q.get("load_in_4bit") or q.get("_load_in_4bit"))
        return Quantization(method="bitsandbytes", bits=4 if four else 8,
                            detail=str(q.get("bnb_4bit_quant_type", "nf4")) if four else "LLM.int8")
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        first = next(iter(groups.values()), {}) if isinstance(groups, Mapping) else {}
        w = first.get("weights") or {} if isinstance(first, Mapping) else {}
        return Quantization(method=method, bits=_int(w.get("num_bits")), group_size=_int(w.get("group_size")),
                            detail=str(w.get("type") or ""))
    if method in ("fp8", "fbgemm_fp8"):
        return Quantization(method=method, bits=8, detail="float")
    bits = _int(q.get("bits", q.get("w_bit")))
    group = _int(q.get("group_size", q.get("q_group_size")))
    return Quantization(method=method or "unknown", bits=bits, group_size=group)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def safetensors_files(folder: Path) -> tuple[Path, ...]:
    """A checkpoint folder's safetensors shards: those ``model.safetensors.index.json`` lists (all present, else none:
    a partial download says nothing of the whole), else ``model.safetensors``, else every ``*.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(load_json(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return ()
        files = tuple(folder / n for n in names)
        return files if all(f.is_file() for f in files) else ()
    if (folder / "model.safetensors").is_file():
        return (folder / "model.safetensors",)
    return tuple(sorted(folder.glob("*.safetensors")))


def checkpoint_info(config: Mapping[str, Any], folder: Path | None,
                    files: tuple[Path, ...] | None = None) -> CheckpointInfo | None:
    """The weights of the checkpoint beside a config.json: ``files`` (else ``folder``'s safetensors shards) read for
    their dtypes, and the config's ``quantization_config``. None where there are neither (a bare config.json)."""
    quant = quantization_of(config)
    if files is None:
        files = safetensors_files(folder) if folder is not None else ()
    stored = read_safetensors(files, quant) if files else ()
    if not stored and quant is None:
        return None
    return CheckpointInfo(files=files, format="safetensors" if stored else "config", stored=stored,
                          quantization=quant)


def stored_weights(name: str, info: CheckpointInfo | None, setup: Setup) -> tuple[Setup, str | None]:
    """``setup`` with the checkpoint's weight format where ``--weights`` was not given (inference: training plans the
    weights as --precision computes them), and the line the plan prints about it.

    A quantised checkpoint and an explicit ``--weights`` of another format are refused: the loaders do not
    re-quantise GPTQ into NF4, say. A 16-bit checkpoint takes any --weights (bitsandbytes and torchao quantise it
    as it loads). A quantisation gpuwise does not lay out (3-bit GPTQ, HQQ) needs --weights for the nearest one."""
    if info is None:
        return setup, None
    note = f"weights as stored: {info.describe()}"
    inference = setup.task in ("infer", "decode")
    if not inference:
        return setup, note + (f"; --task {setup.task} plans them as --precision {setup.precision} computes"
                              if info.quantized else "")
    own = info.weights
    if setup.weights is None:
        if own is None and info.quantized:
            raise GpuwiseError(f"{name} stores its weights as {info.describe()}, a format gpuwise does not lay out",
                               "pass --weights int4 (or int8, nf4, fp8) to plan it as the nearest one")
        if own is None:
            return setup, note
        return replace(setup, weights=own), f"{note}; planned as --weights {own}"
    if info.quantized and own is not None and setup.weights != own:
        raise GpuwiseError(f"--weights {setup.weights} contradicts {name}, whose weights are stored as "
                           f"{info.describe()} (--weights {own})", f"drop --weights (the checkpoint's {own} is "
                           f"planned), or pass --weights {own}")
    return setup, note + (f"; planned as --weights {setup.weights}" if setup.weights != own else "")
