"""training/parallelize.py: checkpointing, FSDP2, compile and DDP applied from outside the model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gpuwise.errors import GpuwiseError
from gpuwise.models.gpt import GPT, GPTConfig
from gpuwise.optim import param_groups
from gpuwise.precision import PRECISIONS
from gpuwise.training.config import TrainConfig
from gpuwise.training.parallelize import apply_fsdp, gradient_sync, parallelize

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)


def _gpt():
    torch.manual_seed(0)
    return GPT(CFG)


@pytest.fixture
def one_process_group():
    """A gloo process group of one: FSDP2 runs in this process, over a mesh of one CPU."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_fsdp_rebuilds_the_optimizer_on_the_shards_and_keeps_its_weight_decay_groups(one_process_group):
    model = _gpt()
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))
    decayed = {n for n, p in model.named_parameters() if any(p is q for q in optimizer.param_groups[0]["params"])}
    sharded = apply_fsdp(model, optimizer, PRECISIONS["bf16-mixed"], device_type="cpu", world_size=1)
    shards = dict(model.named_parameters())
    assert all(type(p).__name__ == "DTensor" for p in shards.values())
    assert [g["weight_decay"] for g in sharded.param_groups] == [0.1, 0.0]
    assert {n for n, p in shards.items() if any(p is q for q in sharded.param_groups[0]["params"])} == decayed
    assert sum(len(g["params"]) for g in sharded.param_groups) == len(shards)
    assert sharded.defaults["betas"] == (0.9, 0.95) and sharded.defaults["lr"] == 1e-3
    with pytest.raises(GpuwiseError, match="--sharding fsdp does not take fp16-mixed"):
        apply_fsdp(_gpt(), optimizer, PRECISIONS["fp16-mixed"], device_type="cpu", world_size=1)


def test_one_process_keeps_the_module_and_autocasts_to_the_precision():
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters())
    for precision, dtype in (("bf16-mixed", torch.bfloat16), ("fp16-mixed", torch.float16), ("fp32", None),
                             ("bf16", None)):
        p = parallelize(model, opt, TrainConfig(precision=precision), device=torch.device("cpu"), world_size=1)
        assert p.model is model and p.optimizer is opt and not p.sharded and p.autocast_dtype == dtype
    with gradient_sync(model, sharded=False, world_size=1, sync=False):  # one process: nothing to hold back
        pass


def test_checkpointing_recomputes_each_block_and_needs_blocks():
    model, plain = _gpt(), _gpt()
    parallelize(model, torch.optim.SGD(model.parameters()), TrainConfig(precision="fp32", checkpointing="full"),
                device=torch.device("cpu"), world_size=1)
    calls = {"checkpointed": 0, "plain": 0}
    for key, net in (("checkpointed", model), ("plain", plain)):
        net.blocks[0].mlp.register_forward_pre_hook(lambda *_, key=key: calls.__setitem__(key, calls[key] + 1))
    idx = torch.randint(64, (2, 16))
    model(idx, idx).backward()
    plain(idx, idx).backward()
    assert calls == {"checkpointed": 2, "plain": 1}  # the block ran again in backward
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)  # recomputation gives the same gradients
    linear = torch.nn.Linear(4, 4)
    with pytest.raises(GpuwiseError, match="--checkpointing full found no repeated blocks in Linear"):
        parallelize(linear, torch.optim.SGD(linear.parameters()), TrainConfig(precision="fp32",
                    checkpointing="full"), device=torch.device("cpu"), world_size=1)
