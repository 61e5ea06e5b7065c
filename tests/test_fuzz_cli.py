"""Random bad values through every command, in-process: each is refused with exit 2 and one ``error:`` line.

Every value drawn here is invalid whatever else is drawn (strategies filter out the valid ones), and each is refused
while the arguments are checked, before a model is captured or a run starts, so the file runs in a few seconds.
``derandomize=True``: the same examples on every run, in CI too.
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwise.cli import main
from gpuwise.hardware.catalog import load_catalog
from gpuwise.models import MODELS

FUZZ = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def refused(argv: list[str]) -> str:
    """Run ``gpuwise *argv`` and check it was refused as a usage error: exit 2, one line ``error: ...``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    text = err.getvalue()
    assert "Traceback" not in text + out.getvalue(), (argv, text)
    assert code == 2, (argv, code, text)
    assert text.endswith("\n") and text.count("\n") == 1 and text.startswith("error: "), (argv, text)
    assert len(text) > len("error: \n"), (argv, text)
    return text


# -- values ---------------------------------------------------------------------------------------------------------

# Odd text: any printable character (no NUL, which no real argv holds; no lone surrogates), mixed with near-miss names.
_TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc")) | st.sampled_from("\n\t\r"), max_size=12)
_NEAR = st.sampled_from(["", " ", "bf17", "BF-16", "fp 32", "ddp,", "h100 ", "gpt3", "llama", "🚀", "e\u0301",
                         "ａｄａｍｗ", "none!", "-", "--", "x" * 300, "a\nb", "cuda:x", "0"])
_WORDS = _NEAR | _TEXT


def _not_in(valid) -> st.SearchStrategy[str]:
    """A word that is none of ``valid`` (compared as a lenient parser might: stripped, any case)."""
    allowed = {v.lower() for v in valid}
    return _WORDS.filter(lambda w: w.strip().lower() not in allowed)


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _maybe_int(text: str) -> bool:
    """What the option parser might take for a whole number: ``int()``'s, and integral floats (pydantic's "1.0")."""
    return _is_int(text) or (_is_float(text) and math.isfinite(float(text)) and float(text).is_integer())


_NOT_INT = _WORDS.filter(lambda w: not _maybe_int(w)) | st.sampled_from(["nan", "inf", "-inf", "1.5", "0x10", "1/2"])
_NOT_FLOAT = _WORDS.filter(lambda w: not _is_float(w)) | st.sampled_from(["1,5", "1e", "--1", "1/2"])
_NOT_POSITIVE = st.integers(max_value=0).map(str)
_HUGE = st.integers(min_value=1 << 31, max_value=1 << 80).map(str)
_BAD_FLOAT = st.sampled_from(["nan", "NaN", "inf", "-inf", "0", "-1", "-1e-9", "1e400"])
_CATALOG = load_catalog()


def _known_gpu(name: str) -> bool:
    try:
        _CATALOG.get(name)
    except Exception:
        return False
    return True


_NOT_GPU = _WORDS.filter(lambda w: w.strip() and not _known_gpu(w))
_NOT_MODEL = _WORDS.filter(lambda w: w.strip().lower() not in MODELS and ":" not in w and ".py" not in w
                           and w.strip())


def opt(flag: str, values: st.SearchStrategy[str]) -> st.SearchStrategy[list[str]]:
    """``--flag=value``: the ``=`` form, so a value that starts with a dash stays a value."""
    return values.map(lambda v: [f"{flag}={v}"])


def _one_of_flags(table: dict[str, st.SearchStrategy[str]]) -> st.SearchStrategy[list[str]]:
    return st.one_of(*(opt(flag, values) for flag, values in table.items()))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Paths that exist but are wrong: a folder, a text file, a Python file without the function, a bad JSON."""
    root = tmp_path_factory.mktemp("fuzz")
    (root / "folder").mkdir()
    (root / "notes.txt").write_text("not python\n")
    (root / "net.py").write_text("def build(batch_size):\n    raise SystemExit('not called')\n")
    (root / "broken.py").write_text("def build(:\n")
    (root / "bad.json").write_text("{not json")
    (root / "empty.csv").write_text("")
    return root


def _paths(root) -> st.SearchStrategy[str]:
    """Where a file.py:function or a data file is expected: paths that are missing, folders or malformed."""
    return st.sampled_from([
        str(root / "missing.py") + ":build", str(root / "folder") + ":build", str(root / "notes.txt") + ":build",
        str(root / "net.py"), str(root / "net.py") + ":", str(root / "net.py") + ":nosuch",
        str(root / "net.py") + ":build:extra", str(root / "broken.py") + ":build", ":build", str(root / "folder"),
        str(root / "missing.py"),
    ])


# -- commands -------------------------------------------------------------------------------------------------------

_PLAN_INTS = ["--batch", "--micro-batch", "--seq", "--image-size", "--gpus", "--tp", "--pp", "--cp", "--nodes"]
_CHOICES = {
    "--precision": ["fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16", "fp8", "fp8-bf16"],
    "--optimizer": ["adamw", "sgd", "adamw8bit", "paged-adamw8bit", "adafactor", "lion"],
    "--checkpointing": ["none", "full", "selective"],
    "--sharding": ["ddp", "zero1", "zero2", "fsdp"],
    "--task": ["train", "finetune-lora", "infer", "decode"],
    "--loss": ["standard", "chunked", "fused"],
    "--offload": ["none", "optimizer", "params"],
}


@given(data=st.data())
@FUZZ
def test_plan_refuses_bad_values(files, data):
    bad = data.draw(st.one_of(
        _one_of_flags({f: _NOT_POSITIVE | _HUGE for f in _PLAN_INTS}),
        _one_of_flags({f: _NOT_INT for f in [*_PLAN_INTS, "--context", "--lora-rank"]}),
        _one_of_flags({f: _not_in(v) for f, v in _CHOICES.items()}),
        _one_of_flags({"--attention": _not_in(["sdpa", "eager", "flash", "flex", "gpuwise"]),
                       "--weights": _not_in(["bf16", "fp16", "fp8", "int8", "int4", "nf4"]),
                       "--gpu": _NOT_GPU, "--model": _NOT_MODEL | _paths(files),
                       "--plot": _WORDS.filter(lambda w: not w.lower().endswith((".png", ".svg")))}),
        st.sampled_from([["--list-models", "--model=gpt2"], ["--task=infer", "--optimizer=sgd"],
                         ["--qlora"], ["--lora-rank=8"], ["--task=infer", "--checkpointing=full"],
                         ["--gpus=4", "--tp=3"], ["--batch=7", "--micro-batch=2"], ["--sharding=fsdp"],
                         ["--task=decode", "--weights=q4_k_m"], ["--precision=fp8", "--task=infer"],
                         ["--hf-config=" + str(files / "missing.json")], ["--model=gpt2", "--hf-config=x.json"],
                         ["--device=cpu:3"], ["--device=tpu"], ["--gpu=,"], ["--seq=2049"], ["--no-such-flag"]]),
    ))
    model = [] if any(a.startswith(("--model", "--hf-config", "--list-models")) for a in bad) else ["--model=gpt2"]
    refused(["plan", *model, *bad])


def test_fuzz_draws_cover_plan_and_are_really_invalid():
    """The choices table is the planner's: a valid value drawn by mistake would pass and fail the fuzz."""
    from typing import get_args

    from gpuwise.planning import setup

    for flag, kind in (("--precision", setup.Precision), ("--optimizer", setup.Optimizer),
                       ("--checkpointing", setup.Checkpointing), ("--sharding", setup.Sharding),
                       ("--task", setup.Task), ("--loss", setup.Loss), ("--offload", setup.Offload)):
        assert set(_CHOICES[flag]) == set(get_args(kind)), flag


_SEGMENTS = ["consumer", "workstation", "datacenter", "edge"]


@given(data=st.data())
@FUZZ
def test_gpus_refuses_bad_values(data):
    from gpuwise.hardware.catalog import SEGMENTS, VENDORS

    bad = data.draw(st.one_of(
        _NOT_GPU.map(lambda w: ["--", w]),  # "--": a name that starts with a dash is still the NAME
        _one_of_flags({"--segment": _not_in(SEGMENTS), "--vendor": _not_in(VENDORS),
                       "--min-memory": st.integers(0, 10**6).map(str) | _NOT_FLOAT.filter(lambda w: w.strip())
                       | st.sampled_from(["24XB", "-24GB", "nanGB", "infGB", "24 G B", "GB", "1e999GB"])}),
        st.sampled_from([["--local", "h100"], ["--local", "--segment=edge"], ["h100", "--vendor=NVIDIA"],
                         ["h100", "a100"], ["--json=yes"]]),
    ))
    refused(["gpus", *bad])


@given(bad=st.sampled_from([["--foo"], ["extra"], ["--json", "--json=1"], ["-x"], ["--jso"]]))
@FUZZ
def test_doctor_refuses_bad_values(bad):
    refused(["doctor", *bad])


@given(data=st.data())
@FUZZ
def test_recommend_refuses_bad_values(files, data):
    from gpuwise.hardware.catalog import ECOSYSTEMS, SEGMENTS, VENDORS

    def listed(valid):  # a comma-separated list with at least one unknown name (or none at all)
        allowed = {v.lower() for v in valid}
        return _WORDS.filter(lambda w: not w.strip(", ") or any(x.strip().lower() not in allowed
                                                                for x in w.split(",") if x.strip()))

    bad = data.draw(st.one_of(
        _one_of_flags({f: _BAD_FLOAT for f in ("--tokens", "--samples", "--budget")}),
        _one_of_flags({f: _NOT_FLOAT for f in ("--tokens", "--samples", "--budget", "--tokens-per-s")}),
        _one_of_flags({f: _NOT_POSITIVE for f in ("--batch", "--max-gpus", "--seq", "--image-size")}),
        _one_of_flags({"--max-gpus": st.integers(1025, 1 << 70).map(str), "--deadline": _WORDS.filter(
            lambda w: not w.strip() or w.strip()[0] not in "0123456789.") | st.sampled_from(["0", "0h", "1e999d"])}),
        _one_of_flags({f: _not_in(v) for f, v in _CHOICES.items() if f not in ("--task", "--offload")}),
        _one_of_flags({"--sort": _not_in(["time", "cost", "energy"]), "--segment": listed(SEGMENTS),
                       "--vendor": listed(VENDORS), "--ecosystem": _not_in(ECOSYSTEMS), "--gpu": _NOT_GPU
                       | st.sampled_from(["", ",", " , "]), "--model": _NOT_MODEL | _paths(files),
                       "--prices": st.sampled_from([str(files / "missing.csv"), str(files / "folder"),
                                                    str(files / "empty.csv"), str(files / "bad.json")]),
                       "--plot": _WORDS.filter(lambda w: not w.lower().endswith((".png", ".svg")))}),
        st.sampled_from([["--serve", f"{f}={v}"] for f, v in (("--prompt-tokens", "0"), ("--output-tokens", "-1"),
                                                              ("--concurrency", "0"), ("--ttft-ms", "nan"),
                                                              ("--tpot-ms", "-5"), ("--tokens-per-s", "inf"),
                                                              ("--weights", "q5"), ("--seq", "128"))]),
        st.sampled_from([["--epochs=3"], ["--dataset-size=10"], ["--epochs=-1", "--dataset-size=-5"],
                         ["--epochs=nan", "--dataset-size=5"], ["--epochs=2", "--dataset-size=0"],
                         ["--epochs=1", "--dataset-size=5", "--tokens=1e9"], ["--tokens=1e9", "--samples=5"],
                         ["--task=decode"], ["--tp=2"], ["--offload=optimizer"], ["--weights=int4"],
                         ["--deadline=36h"], ["--budget=5"], ["--qlora"], ["--serve", "--loss=chunked"],
                         ["--serve", "--compile"], ["--sharding=zero4"], ["--prompt-tokens=7"]]),
    ))
    model = [] if any(a.startswith("--model") for a in bad) else ["--model=gpt2"]
    refused(["recommend", *model, *bad])


@given(data=st.data())
@FUZZ
def test_train_refuses_bad_values(files, data):
    bad = data.draw(st.one_of(
        _one_of_flags({f: _NOT_POSITIVE for f in ("--steps", "--batch", "--micro-batch", "--seq", "--log-every",
                                                  "--gpus")}),
        _one_of_flags({f: st.integers(max_value=-1).map(str) for f in ("--workers", "--eval-every",
                                                                       "--checkpoint-every", "--seed")}),
        _one_of_flags({"--steps": st.integers(1 << 31 + 1, 1 << 80).map(str),
                       "--seed": st.integers(1 << 32, 1 << 80).map(str),
                       "--lr": st.sampled_from(["0", "-1", "nan", "inf", "-inf", "1e400"]) | _NOT_FLOAT,
                       "--data-timeout": st.sampled_from(["0", "-5", "nan", "inf", "-inf"]) | _NOT_FLOAT}),
        _one_of_flags({f: _not_in(v) for f, v in _CHOICES.items()
                       if f not in ("--optimizer", "--sharding", "--task", "--offload")}),
        _one_of_flags({"--example": _not_in(["text", "image"]), "--model": _paths(files),
                       "--device": st.sampled_from(["cpu:3", "tpu", "", "cuda:x", "gpu", "cpu:-1"])}),
        st.sampled_from([["--optimizer=sgd"], ["--sharding=zero1"], ["--task=infer"], ["--qlora"], ["--lora-rank=8"],
                         ["--weights=int4"], ["--context=5"], ["--tp=2"], ["--pp=2"], ["--offload=params"],
                         ["--optimizer-in-backward"], ["--batch=10", "--micro-batch=3"], ["--resume"],
                         ["--fix-input", "--no-monitor"], ["--data=x.py:ds"], ["--example=image", "--seq=64"],
                         ["--image-size=16"], ["--log=" + str(files / "folder")]]),
    ))
    refused(["train", *bad])


@given(data=st.data())
@FUZZ
def test_bench_refuses_bad_values(files, data):
    from gpuwise.bench import DTYPES, OPS

    def listed(valid):  # comma-separated, with an unknown name or no name at all
        return _WORDS.filter(lambda w: any(x.strip().lower() not in valid for x in w.split(",") if x.strip())
                             or not w.strip(", "))

    bad = data.draw(st.one_of(
        _one_of_flags({"--ops": listed(OPS), "--dtype": listed(DTYPES),
                       "--plot": _WORDS.filter(lambda w: not w.lower().endswith((".png", ".svg"))),
                       "--device": st.sampled_from(["cpu:3", "tpu", "", "cuda:x", "gpu"]),
                       "--case-limit": st.sampled_from(["-1", "nan", "inf", "x"])}),
        st.sampled_from([[f"--compare={files / 'missing.json'}", f"--compare={files / 'folder'}"],
                         ["--compare=a.json", "--compare=b.json", "--quick"], ["--compare=a", "--compare=b",
                                                                               "--compare=c"],
                         ["--calibrate", "--ops=attention"], [f"--compare={files / 'bad.json'}", "--compare=x.json"],
                         [f"--compare={files / 'folder'}", f"--compare={files / 'missing.json'}"],
                         [f"--save={files / 'folder'}", "--ops=gemm"], ["--quick=1"]]),
    ))
    refused(["bench", *bad])


@given(data=st.data())
@FUZZ
def test_watch_refuses_bad_values(files, data):
    bad = data.draw(st.one_of(
        _one_of_flags({"--interval": st.sampled_from(["0", "-1", "nan", "0.001", "-inf"]) | _NOT_FLOAT,
                       "--pid": _NOT_POSITIVE | _NOT_INT}).map(lambda a: [*a, "--", "true"]),
        _one_of_flags({"--plot": _WORDS.filter(lambda w: not w.lower().endswith((".png", ".svg"))) | st.sampled_from(
            [str(files / "missing" / "t.png")])}).map(lambda a: [*a, "--", "true"]),
        st.sampled_from([[], ["--pid=1", "--", "true"], ["--pid=999999999"], ["--", str(files / "missing")],
                         [f"--log={files / 'missing' / 'x.jsonl'}", "--", "true"]]),
    ))
    refused(["watch", *bad])
