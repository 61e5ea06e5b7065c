"""A model factory from the Python API: ``gpuwise.plan(lambda: MyNet(), setup)`` plans what ``--model
file.py:function`` plans for the same model, and never keeps its captures on disk."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import gpuwise
from gpuwise.errors import GpuwiseError
from gpuwise.planning import Setup, plan_model
from gpuwise.planning.capture import cache
from gpuwise.planning.sources.factory import FactorySource
from gpuwise.planning.sources.resolve import resolve_source


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 10)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


TINY_PARAMS = 64 * 256 + 256 + 256 * 10 + 10  # two linear layers with biases: 19,210


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.head = nn.Embedding(100, 32), nn.Linear(32, 100)

    def forward(self, ids):
        return self.head(self.wte(ids))


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text("import torch\nfrom torch import nn\n\n" + inspect.getsource(Tiny)  # the same class
                    + "\n\ndef build(batch_size):\n    return Tiny(), torch.randn(batch_size, 64)\n")
    return f"{path}:build"


@pytest.mark.parametrize("setup", [Setup(micro_batch=4), Setup(task="infer", micro_batch=8)])
def test_a_factory_plans_as_the_file_function(user_file, setup):
    by_factory = gpuwise.plan(lambda: Tiny(), setup, gpu="h100-sxm")
    by_file = plan_model(user_file, setup, gpu="h100-sxm")
    assert by_factory.params == by_file.params == TINY_PARAMS
    assert by_factory.peak_bytes == by_file.peak_bytes
    assert by_factory.breakdown == by_file.breakdown
    assert by_factory.flops_per_step == by_file.flops_per_step
    assert by_factory.model == "Tiny (factory)"


def test_a_factory_of_the_batch_is_the_file_functions_contract(user_file):
    def build(batch_size):
        return Tiny(), torch.randn(batch_size, 64)

    setup = Setup(micro_batch=4)
    by_file = plan_model(user_file, setup, gpu="h100-sxm")
    assert plan_model(build, setup, gpu="h100-sxm").peak_bytes == by_file.peak_bytes


def test_a_token_model_takes_seq_ids():
    p = gpuwise.plan(TinyLM, Setup(task="infer", micro_batch=2, seq=16), gpu="h100-sxm")
    assert p.params == 100 * 32 + 32 * 100 + 100 and p.tokens_per_step == 2 * 16
    with pytest.raises(GpuwiseError, match=r"no sequence length.*|Setup\(seq=N\)"):
        gpuwise.plan(TinyLM, Setup(task="infer"), gpu="h100-sxm")
    with pytest.raises(GpuwiseError, match="--seq does not apply"):
        gpuwise.plan(lambda: Tiny(), Setup(seq=16), gpu="h100-sxm")


def test_what_a_factory_cannot_be():
    with pytest.raises(GpuwiseError, match="a built Tiny holds real tensors"):
        resolve_source(Tiny(), None)
    with pytest.raises(GpuwiseError, match=r"cannot tell the inputs of Sequential: its first layer is LayerNorm"):
        gpuwise.plan(lambda: nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)), Setup(), gpu="h100-sxm")
    with pytest.raises(GpuwiseError, match=r"returned int, not an nn\.Module"):
        gpuwise.plan(lambda: 3, Setup(), gpu="h100-sxm")


@pytest.mark.own_captures
def test_a_factorys_captures_are_never_kept_on_disk():
    source = resolve_source(lambda: Tiny(), None)
    assert isinstance(source, FactorySource) and cache.source_key(source) is None
    where = cache.folder()
    gpuwise.plan(source, Setup(micro_batch=2), gpu="h100-sxm")
    assert not where.exists() or not any(where.iterdir())
    gpuwise.plan("gpt2", Setup(micro_batch=1, seq=32, task="infer"), gpu="h100-sxm")  # a zoo model's are kept
    assert any(where.iterdir())
