import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwise.errors import GpuwiseError
from gpuwise.units import GB, GiB, MiB, human_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GB", 24 * 10**9),
        ("24 GiB", 24 * 2**30),
        ("24gib", 24 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5TB", 1_500_000_000_000),
        ("80G", 80 * 10**9),
        ("1024", 1024),
        ("0.5 GiB", 2**29),
    ],
)
def test_parse_bytes_reads_decimal_and_binary_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "24 XB", "GB", "-3GB", "1e9"])
def test_parse_bytes_rejects_nonsense_with_a_hint(text):
    with pytest.raises(GpuwiseError) as info:
        parse_bytes(text)
    assert "24GiB" in info.value.hint


@given(st.integers(min_value=0, max_value=2**32))
def test_parse_bytes_round_trips_plain_and_gib(n):
    assert parse_bytes(f"{n}B") == n
    assert parse_bytes(f"{n} GiB") == n * GiB


def test_parse_bytes_refuses_sizes_past_int64():
    assert parse_bytes("7000000000GB") == 7 * 10**18
    with pytest.raises(GpuwiseError, match="too large"):
        parse_bytes("10" + "0" * 30 + "TB")


def test_human_bytes_uses_binary_units_by_default():
    assert human_bytes(80 * GiB) == "80 GiB"
    assert human_bytes(1.5 * GiB) == "1.5 GiB"
    assert human_bytes(64 * MiB) == "64 MiB"
    assert human_bytes(512) == "512 B"
    assert human_bytes(80 * GB, binary=False) == "80 GB"
    assert human_bytes(None) == "-"
