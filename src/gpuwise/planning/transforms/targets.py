"""Which layers ``--lora-targets`` names, as Hugging Face PEFT's ``LoraConfig(target_modules=...)`` reads them
(peft/tuners/tuners_utils.py, ``check_target_module_exists`` and ``_maybe_include_all_linear_layers``):

- a name matches a layer whose qualified name is that name or ends with ``.name`` (``q_proj``, ``attention.wq``);
- ``all-linear``: every ``nn.Linear`` except the output head (PEFT leaves out ``get_output_embeddings()``);
- ``re:PATTERN``: a regular expression the whole qualified name must match (PEFT's ``target_modules`` string);
- a name with ``*``, ``?`` or ``[``: an fnmatch pattern on the qualified name (``blocks.*.attention.w[qv]``);
- the short names q, k, v, o, gate, up, down: the attention and MLP projections under the names the zoo and the
  common Hugging Face models give them (``SHORT_NAMES``).

Without torch: a Setup checks the flag as written (``check_targets``) before torch loads; lora.py applies the items
to a model's layers (``select_targets``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable

from gpuwise.errors import GpuwiseError

# Short LoRA target names: the leaf names each stands for in the zoo (llama.py: wq..w3, bert.py: query..attn_out)
# and in Hugging Face models (Llama/Mistral/Qwen: q_proj..down_proj, BERT: query/key/value, DistilBERT: q_lin..).
SHORT_NAMES: dict[str, tuple[str, ...]] = {
    "q": ("q_proj", "wq", "query", "q_lin", "to_q"),
    "k": ("k_proj", "wk", "key", "k_lin", "to_k"),
    "v": ("v_proj", "wv", "value", "v_lin", "to_v"),
    "o": ("o_proj", "wo", "out_proj", "attn_out", "out_lin"),
    "gate": ("gate_proj", "w1"),
    "up": ("up_proj", "w3"),
    "down": ("down_proj", "w2"),
}
ALL_LINEAR = "all-linear"
_GLOB = re.compile(r"[*?\[]")


def check_targets(text: str) -> None:
    """``--lora-targets`` as written, before any model is seen: items, and a regular expression that compiles."""
    flag = f"--lora-targets {text!r}"
    if text.startswith("re:"):
        try:
            re.compile(text[3:])
        except re.error as exc:
            raise GpuwiseError(f"{flag} is not a regular expression ({exc})", "fix the pattern after re:") from exc
        if not text[3:]:
            raise GpuwiseError(f"{flag} has an empty pattern", "pass e.g. --lora-targets 're:.*\\.(q|v)_proj'")
        return
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or not all(items):
        raise GpuwiseError(f"{flag} has an empty name", "pass names separated by commas, e.g. --lora-targets q,v")


def target_items(text: str) -> list[tuple[str, Callable[[str, bool], bool]]]:
    """(item, match(qualified name, is the head)) for each item of ``--lora-targets``."""
    if text.startswith("re:"):
        pattern = re.compile(text[3:])
        return [(text, lambda name, head: pattern.fullmatch(name) is not None)]

    def suffix(item: str) -> Callable[[str, bool], bool]:
        return lambda name, head: name == item or name.endswith("." + item)

    out: list[tuple[str, Callable[[str, bool], bool]]] = []
    for item in (t.strip() for t in text.split(",")):
        if item == ALL_LINEAR:
            out.append((item, lambda name, head: not head))
        elif _GLOB.search(item):
            out.append((item, lambda name, head, item=item: fnmatch.fnmatchcase(name, item)))
        elif item in SHORT_NAMES:
            leaves, plain = SHORT_NAMES[item], suffix(item)
            out.append((item, lambda name, head, leaves=leaves, plain=plain:
                        name.rpartition(".")[2] in leaves or plain(name, head)))
        else:
            out.append((item, suffix(item)))
    return out
