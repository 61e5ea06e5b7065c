"""--json and the training log are strict JSON: a figure that is infinite or not a number is null."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pytest

from conftest import run_cli
from gpuwise.render import SCHEMA_VERSION
from gpuwise.render._common import print_json, to_jsonable


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@dataclass
class _Inner:
    rate: float
    fine: float = 1.5


@dataclass
class _Outer:
    inner: _Inner
    many: list = field(default_factory=list)
    named: dict = field(default_factory=dict)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_figures_are_null_wherever_they_sit(bad, capsys):
    data = _Outer(_Inner(bad), [bad, 2.0, (_Inner(bad),)], {"x": bad, "y": 3})
    print_json(data)
    got = _strict(capsys.readouterr().out)
    assert got == {"inner": {"rate": None, "fine": 1.5}, "many": [None, 2.0, [{"rate": None, "fine": 1.5}]],
                   "named": {"x": None, "y": 3}}
    assert to_jsonable(True) is True and to_jsonable(7) == 7  # bools and ints are not floats to clean


@pytest.mark.parametrize("argv, key", [(["gpus"], "accelerators"), (["gpus", "h100"], "accelerators"),
                                       (["gpus", "--local"], "devices"), (["doctor"], "findings"),
                                       (["plan", "--list-models"], "models"), (["plan", "--model", "mlp"], "gpus")])
def test_every_command_prints_one_object_with_its_schema_version_first(capsys, argv, key):
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code in (0, 1), err  # doctor exits 1 when a check fails
    data = _strict(out)
    assert isinstance(data, dict) and next(iter(data)) == "schema_version" and data["schema_version"] == SCHEMA_VERSION
    assert isinstance(data[key], list) and data[key]
