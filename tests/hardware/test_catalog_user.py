"""User catalogs: rows from GPUWISE_CATALOG and the config folder laid over the built-in rows."""

import json
import os

import pytest

from conftest import run_cli
from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import load_catalog, user_catalog_files
from gpuwise.units import GiB

# A made-up card with the minimum fields (the module docstring's example).
NEW_ROW = """
[[accelerator]]
key = "my-card"
name = "Example Card 48GB"
vendor = "NVIDIA"
segment = "workstation"
arch = "Ada Lovelace (AD102)"
memory_gib = 48
memory_bandwidth_gbps = 960
peak_tflops = { fp32 = 91.1, bf16 = 181.0 }
ecosystem = "cuda"
node_gpus = 1
source = "vendor datasheet https://example.com/card.pdf, 2026-05"
"""
# Re-prices the built-in RTX 4090 and adds an alias, leaving every other field as shipped.
OVERRIDE = """
[[accelerator]]
key = "rtx-4090"
aliases = ["my lab 4090"]
peak_tflops = { bf16 = 150.0 }
cloud_usd_per_hour = 0.59
cloud_price_source = "my provider's invoice, 2026-07"
cloud_price_date = "2026-07"
source = "our own GEMM benchmark"
"""


@pytest.fixture
def env(tmp_path):
    """An environment with an empty config folder, as the CLI would read it."""
    return {"XDG_CONFIG_HOME": str(tmp_path / "config")}


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_new_row_adds_a_gpu_and_the_built_in_rows_stay(tmp_path, env):
    path = _write(tmp_path, "mine.toml", NEW_ROW)
    cat = load_catalog(environ={**env, "GPUWISE_CATALOG": str(path)})
    builtin = load_catalog(environ=env)
    assert len(cat) == len(builtin) + 1 and [a.key for a in cat][:-1] == [a.key for a in builtin]
    card = cat.get("example card 48gb")
    assert (card.key, card.memory_bytes, card.peak_tflops.bf16, card.compute_capability) == ("my-card", 48 * GiB,
                                                                                              181.0, None)
    assert card.source.startswith(f"user catalog {path}: vendor datasheet")
    assert builtin.find("my-card") is None  # nothing leaks into the catalog without the variable


def test_an_existing_key_overrides_only_the_fields_given(tmp_path, env):
    path = _write(tmp_path, "price.toml", OVERRIDE)
    shipped = load_catalog(environ=env).get("rtx-4090")
    row = load_catalog(environ={**env, "GPUWISE_CATALOG": str(path)}).get("my lab 4090")
    assert row.key == "rtx-4090" and row.aliases == (*shipped.aliases, "my lab 4090")
    assert (row.cloud_usd_per_hour, row.cloud_price_date, row.peak_tflops.bf16) == (0.59, "2026-07", 150.0)
    # every other figure is the shipped one, dtype by dtype
    assert (row.peak_tflops.fp8, row.memory_bytes, row.sm_count) == (330.3, 24 * GiB, 128)
    assert shipped.peak_tflops.fp8 == 330.3 and row.peak_tflops.fp8 == shipped.peak_tflops.fp8
    assert "sets peak_tflops" not in row.source and "cloud_usd_per_hour" in row.source and "bf16" in row.source
    assert row.source.endswith(shipped.source)


def test_the_config_folder_file_applies_first_and_the_variable_wins(tmp_path, env):
    folder = tmp_path / "config" / "gpuwise"
    folder.mkdir(parents=True)
    (folder / "catalog.toml").write_text(NEW_ROW)
    later = _write(tmp_path, "later.toml", '[[accelerator]]\nkey = "my-card"\nmemory_gib = 96\nsource = "refit"\n')
    assert user_catalog_files(env) == (folder / "catalog.toml",)
    assert load_catalog(environ=env).get("my-card").memory_bytes == 48 * GiB
    both = {**env, "GPUWISE_CATALOG": os.pathsep.join([str(later), ""])}
    assert user_catalog_files(both) == (folder / "catalog.toml", later)
    assert load_catalog(environ=both).get("my-card").memory_bytes == 96 * GiB


def test_an_edited_file_is_read_again(tmp_path, env):
    path = _write(tmp_path, "mine.toml", NEW_ROW)
    environ = {**env, "GPUWISE_CATALOG": str(path)}
    first = load_catalog(environ=environ)
    assert load_catalog(environ=environ) is first  # cached while nothing changes
    path.write_text(NEW_ROW.replace("memory_gib = 48", "memory_gib = 64"))
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)
    assert load_catalog(environ=environ).get("my-card").memory_bytes == 64 * GiB


def test_every_bad_field_is_named_with_its_file_row_and_fix(tmp_path, env):
    bad = NEW_ROW.replace('segment = "workstation"', 'segment = "gaming"').replace("memory_gib = 48",
                                                                                   'memory_gib = "48"')
    bad += '[[accelerator]]\nkey = "4090"\nname = "x"\n'  # a new key that is already a built-in row's name
    bad += '[[accelerator]]\nkey = "rtx-3090"\ncloud_usd_per_hour = 0.2\n'  # a price without its source and date
    path = _write(tmp_path, "bad.toml", bad)
    with pytest.raises(GpuwiseError) as info:
        load_catalog(environ={**env, "GPUWISE_CATALOG": str(path)})
    problems = info.value.message.removeprefix("bad user catalog: ").split("; ")
    assert problems[0] == f"{path}: row 'my-card': segment 'gaming' is not one of " \
                          "('consumer', 'workstation', 'datacenter', 'edge')"
    assert problems[1] == f"{path}: row 'my-card': memory_gib '48' must be a number > 0"
    assert problems[2] == "write it without quotes"  # the "; fix" part of the same problem
    assert f"{path}: row '4090': '4090' already names row 'rtx-4090'; write key = \"rtx-4090\"" in info.value.message
    assert f"{path}: row 'rtx-3090': cloud_usd_per_hour needs ['cloud_price_source', 'cloud_price_date']" in \
        info.value.message
    assert "GPUWISE_CATALOG" in info.value.hint


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[accelerator]\nkey = 1", "not valid TOML"),
        ('[gpu]\nkey = "x"\n', "unknown top-level keys ['gpu']; each GPU is an [[accelerator]] table"),
        ('[[accelerator]]\nkey = "new"\nname = "New"\n', "row 'new': missing 'vendor'"),
        ('[[accelerator]]\nname = "New"\n', "row 1: missing 'key'"),
        ('[[accelerator]]\nkey = "t4"\n[[accelerator]]\nkey = "t4"\n', "row 't4': the key is given twice"),
        ('[[accelerator]]\nkey = "t4"\npeak_tflops = { bf16 = "fast" }\n', "peak_tflops.bf16 'fast' must be a number"),
        ('[[accelerator]]\nkey = "t4"\naliases = "tesla"\n', "aliases 'tesla' must be a list of strings"),
        ('[[accelerator]]\nkey = "t4"\naliases = ["a100"]\n',
         "catalog name 'a100' of 'a100-40gb-sxm' clashes with 't4'"),
    ],
)  # fmt: skip
def test_malformed_user_files_are_one_clear_error(tmp_path, env, text, message):
    path = _write(tmp_path, "bad.toml", text)
    with pytest.raises(GpuwiseError, match="bad user catalog") as info:
        load_catalog(environ={**env, "GPUWISE_CATALOG": str(path)})
    assert message in info.value.message and str(path) in info.value.message


def test_a_missing_file_in_the_variable_is_an_error(tmp_path, env):
    with pytest.raises(GpuwiseError, match=r"GPUWISE_CATALOG names .*nope\.toml, which is not a file"):
        load_catalog(environ={**env, "GPUWISE_CATALOG": str(tmp_path / "nope.toml")})


def test_an_explicit_path_reads_that_file_alone(tmp_path):
    path = _write(tmp_path, "only.toml", NEW_ROW)
    assert [a.key for a in load_catalog(path)] == ["my-card"]


def test_plan_and_gpus_see_a_user_row(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("GPUWISE_CATALOG", str(_write(tmp_path, "mine.toml", NEW_ROW)))
    code, out, err = run_cli(capsys, "plan", "--model", "gpt2", "--batch", "1", "--gpu", "my-card", "--json")
    assert code == 0, err
    assert [g["gpu"] for g in json.loads(out)["gpus"]] == ["my-card"]
    code, out, _ = run_cli(capsys, "gpus", "--json")
    assert code == 0 and "my-card" in [row["key"] for row in json.loads(out)["accelerators"]]
    code, out, err = run_cli(capsys, "recommend", "--model", "gpt2", "--seq", "64", "--batch", "8", "--tokens", "1e7",
                             "--gpu", "my-card", "--max-gpus", "1", "--json")
    assert code == 0, err
    assert [(r["gpu"], r["fits"]) for r in json.loads(out)["rows"]] == [("my-card", True)]


def test_a_bad_user_row_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    path = _write(tmp_path, "bad.toml", NEW_ROW.replace("node_gpus = 1", "node_gpus = 0"))
    monkeypatch.setenv("GPUWISE_CATALOG", str(path))
    code, out, err = run_cli(capsys, "plan", "--model", "gpt2", "--batch", "1", "--gpu", "my-card")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"{path}: row 'my-card': node_gpus 0 must be a whole number >= 1" in err
