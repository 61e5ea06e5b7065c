"""``--hf-config`` as a training task (tasks.py ``hf_task``): transformers' model of the config, built for real, its
synthetic batch, and its own loss checked against a hand-written shifted cross-entropy."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gpuwise.errors import GpuwiseError
from gpuwise.training.tasks import hf_loss, hf_task

pytest.importorskip("transformers")

# A Llama cut to nothing: 28,832 parameters by hand (embeddings 128 x 32 and an untied head of as many; a block: q, k,
# v and o 32 x 32, the MLP 3 x 32 x 64, two norms of 32; the final norm)
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
              "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 128, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2}
TINY_LLAMA_PARAMS = 2 * 128 * 32 + 2 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32


def _write(tmp_path, cfg: dict, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def test_the_model_is_transformers_own_with_the_plans_sequence(tmp_path):
    config = _write(tmp_path, TINY_LLAMA)
    task = hf_task(config, None, None, batch=4, seed=7, workers=0)
    torch.manual_seed(0)
    model = task.build()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == TINY_LLAMA_PARAMS
    assert model.config.use_cache is False  # as the planned training step runs it
    assert task.seq == 64 and task.unit == "tokens"  # the default 128 capped at max_position_embeddings
    x, y = task.data.batch(0, 4)
    ids = x["input_ids"]
    assert ids.shape == (4, 64) and ids.dtype == torch.long and int(ids.min()) >= 0 and int(ids.max()) < 128
    assert torch.equal(y, ids)  # a causal LM's labels are its inputs (transformers shifts them in the loss)
    assert torch.equal(task.data.batch(9, 4)[0]["input_ids"], ids)  # one repeated batch

    def tokens(seed: int) -> torch.Tensor:
        return hf_task(config, None, 16, batch=4, seed=seed, workers=0).data.batch(0, 4)[0]["input_ids"]

    assert tokens(7).shape == (4, 16) and torch.equal(tokens(7), tokens(7))  # fixed by the seed...
    assert not torch.equal(tokens(7), tokens(8))  # ...and drawn by it


def test_the_loss_is_the_models_own_shifted_cross_entropy(tmp_path):
    task = hf_task(_write(tmp_path, TINY_LLAMA), None, 16, batch=2, seed=0, workers=0)
    torch.manual_seed(0)
    model = task.build()
    x, y = task.data.batch(0, 2)
    loss = task.loss_fn(model, x, y)
    logits = model(input_ids=x["input_ids"]).logits  # next-token prediction, by hand
    by_hand = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), y[:, 1:].reshape(-1))
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    assert loss.item() == pytest.approx(math.log(128), abs=0.1)  # small random weights: about uniform at first
    # a Dataset's (ids, labels) pairs reach the model as input_ids and labels too
    assert hf_loss("input_ids")(model, x["input_ids"], y).item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_a_classifier_gets_a_class_per_sample(tmp_path):
    bert = {"architectures": ["BertForSequenceClassification"], "model_type": "bert", "hidden_size": 32,
            "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2, "vocab_size": 100,
            "max_position_embeddings": 64, "num_labels": 3}
    task = hf_task(_write(tmp_path, bert), None, 8, batch=4, seed=0, workers=0)
    x, y = task.data.batch(0, 4)
    assert x["input_ids"].shape == (4, 8) and y.shape == (4,) and int(y.max()) < 3
    assert task.unit == "samples"


@pytest.mark.parametrize(("cfg", "seq", "message"), [
    ({**TINY_LLAMA, "architectures": ["LlamaModel"]}, None, "LlamaModel has no head whose loss takes labels"),
    (TINY_LLAMA, 65, "--seq 65 is longer than the config's 64 positions"),
    ({"architectures": ["ViTForImageClassification"], "model_type": "vit", "hidden_size": 32,
      "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2, "image_size": 32, "patch_size": 8},
     16, "--seq does not apply to ViTForImageClassification, which takes pixel_values"),
])
def test_what_cannot_train_is_refused(tmp_path, cfg, seq, message):
    with pytest.raises(GpuwiseError, match=message):
        hf_task(_write(tmp_path, cfg), None, seq, batch=2, seed=0, workers=0)
