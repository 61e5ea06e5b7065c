"""Tiny zoo models several test files plan: a 4-block GPT and Llama of width 256, each with its Planner (the
captures, shared by the tests that read them)."""

from __future__ import annotations

from dataclasses import replace

from gpuwise.models import get_model
from gpuwise.models.gpt import GPTConfig
from gpuwise.models.llama import LlamaConfig
from gpuwise.planning.planner import Planner
from gpuwise.planning.sources.zoo import ZooSource

H, HEADS, SEQ, B = 256, 8, 128, 2
# A GPT block as Korthikanti et al. assume it (LayerNorm, 4h GeLU MLP, 16-bit), without dropout and with flash
# attention (SDPA): their per-layer sbh(10 + 24/t + 5as/(ht)) loses the two 1-byte dropout masks outside the
# attention (10 -> 8) and the attention-score term (flash keeps only an fp32 logsumexp, 4 bytes x a x s x b / t).
GPT = ZooSource(zoo=replace(get_model("gpt2"), name="gpt-tp-test",
                            config=GPTConfig(n_layer=4, n_head=HEADS, n_embd=H, vocab_size=512, block_size=SEQ)))
LLAMA = ZooSource(zoo=replace(get_model("llama2-7b"), name="llama-tp-test", default_seq=SEQ,
                              config=LlamaConfig(n_layer=4, n_head=HEADS, n_kv_head=4, dim=H, ffn_dim=688,
                                                 vocab_size=512)))

PLANNERS = {GPT.name: Planner(GPT), LLAMA.name: Planner(LLAMA)}  # the captures, shared by the tests below
