"""transformers' generate on this GPU at batch 1, 8 and 64 against the serving model's prediction for the ``hf``
runtime (issue 28: the one runtime without a published run to fit on). A Llama-3.2-1B-shaped model from its config
(random bf16 weights: no download), a 512-token prompt, 128 new tokens (forced: no early stop), static batching.

Prints, per batch: measured and predicted output tokens/s (the whole batch) and time per output token, and their
ratio; writes the table to ``--out`` if given. Needs a CUDA GPU and transformers; on a machine without either it
says so and exits 2.

    PYTHONPATH=src python benchmarks/hf_generate.py [--out table.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# Llama-3.2-1B's config.json (meta-llama/Llama-3.2-1B), the fields that shape the model
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
          "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
          "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
          "tie_word_embeddings": True, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}
PROMPT, NEW = 512, 128


def measure(batch: int) -> tuple[float, float]:
    """(seconds for the whole generate, seconds of the prefill alone) at ``batch``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "architectures"}))
    model = model.to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, CONFIG["vocab_size"], (batch, PROMPT), device="cuda")
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1})
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return total, prefill


def predict(batch: int, gpu: str):
    from gpuwise.hardware.catalog import load_catalog
    from gpuwise.planning.cost.llm_step import step_seconds
    from gpuwise.planning.cost.load import serve_load
    from gpuwise.planning.cost.replica import model_shape
    from gpuwise.planning.cost.runtimes import RUNTIMES
    from gpuwise.planning.planner import Planner
    from gpuwise.planning.sources.hf import HFSource

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(CONFIG))
        source = HFSource.from_path(path)
        shape, _ = model_shape(Planner(source), source.decoder, context=PROMPT + NEW // 2)
    acc, rt = load_catalog().get(gpu), RUNTIMES["hf"]

    def step(d, p, ps):
        return step_seconds(shape, acc, rt, decode=d, context=PROMPT + NEW / 2, prefill=p, prefill_seqs=ps)

    return serve_load(step, rt, prompt=PROMPT, output=NEW, capacity=batch, concurrency=batch)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default=None, help="catalog key to predict for [the detected GPU's]")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"error: {exc.name} is not installed; this benchmark needs torch with CUDA and transformers")
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA GPU; run this on a GPU machine (benchmarks/gpu_check.sh does)")
        return 2
    gpu = args.gpu
    if gpu is None:
        from gpuwise.hardware.device import local_accelerator

        gpu = local_accelerator().key
    lines = [f"transformers generate, Llama-3.2-1B shape, bf16, {PROMPT} in / {NEW} out, on {gpu}",
             "| batch | measured tok/s | predicted tok/s | ratio | measured ms/token | predicted ms/token |",
             "|---:|---:|---:|---:|---:|---:|"]
    for batch in (1, 8, 64):
        total, prefill = measure(batch)
        got = batch * NEW / total
        tpot = (total - prefill) / (NEW - 1)
        p = predict(batch, gpu)
        lines.append(f"| {batch} | {got:,.0f} | {p.output_tokens_per_s:,.0f} | {p.output_tokens_per_s / got:.2f} | "
                     f"{tpot * 1e3:.2f} | {p.tpot_s * 1e3:.2f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
