"""The catalog against datasheet figures and first-principles derivations, and its look-up rules."""

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import DTYPES, SEGMENTS, load_catalog, normalize_name, parse_catalog
from gpuwise.units import GB, GiB

CATALOG = load_catalog()

# The rows the catalog must have, by a name a user would type.
REQUIRED = [
    "RTX 3060 12GB", "RTX 4060 Ti 16GB", "RTX 3090", "RTX 4090", "RTX 5090", "RTX 6000 Ada",
    "RTX PRO 6000 Blackwell", "T4", "V100", "A10", "A100 40GB", "A100 80GB", "L4", "L40S", "H100 SXM",
    "H100 PCIe", "H200", "B200", "GB200", "MI250X", "MI300X", "MI325X", "Gaudi 2", "Gaudi 3",
    "Ascend 910B", "TPU v5e", "TPU v5p", "M2 Ultra", "M3 Max", "M4 Max", "Jetson AGX Orin", "Coral Edge TPU",
]  # fmt: skip


def test_catalog_has_every_required_row_and_at_least_30():
    assert len(CATALOG) >= 30
    found = {name: CATALOG.get(name).key for name in REQUIRED}
    assert len(set(found.values())) == len(REQUIRED), found  # each name its own row


def test_headline_figures_match_the_datasheets():
    # NVIDIA H100 datasheet (SXM): 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity -> 989.5 dense.
    h100 = CATALOG.get("h100")
    assert h100.name.startswith("NVIDIA H100 SXM")
    assert h100.memory_bytes == 80 * GiB
    assert h100.memory_bandwidth_gbps == 3350
    assert h100.peak_tflops.bf16 == pytest.approx(989.5)
    # NVIDIA H200 page: 141 GB HBM3e at 4.8 TB/s.
    h200 = CATALOG.get("h200")
    assert (h200.memory_bytes, h200.memory_bandwidth_gbps) == (141 * GiB, 4800)
    # Ada whitepaper appendix: RTX 4090 FP16/BF16 tensor with FP32 accumulate, dense: 165.2.
    rtx = CATALOG.get("4090")
    assert (rtx.memory_bytes, rtx.memory_bandwidth_gbps) == (24 * GiB, 1008)
    assert rtx.peak_tflops.bf16 == pytest.approx(165.2)


@pytest.mark.parametrize(
    ("name", "units", "flops_per_clock", "ghz", "dtype"),
    [
        # Dense tensor rate = tensor cores x FLOPs per core per clock x boost clock.
        ("h100", 528, 1024, 1.830, "bf16"),  # Hopper whitepaper: 132 SMs x 4 TCs, 512 FMA/clk (dense fp16)
        ("a100", 432, 512, 1.410, "bf16"),  # Ampere whitepaper: 108 SMs x 4 TCs, 256 FMA/clk
        ("4090", 512, 128, 2.520, "bf16"),  # Ada: 512 TCs, fp32 accumulate at half the fp16-acc rate
        ("mi300x", 1216, 512, 2.100, "bf16"),  # CDNA3 whitepaper: 304 CUs x 4 matrix cores, 2.1 GHz
        ("h100", 16896, 2, 1.980, "fp32"),  # 16,896 FP32 lanes x FMA x 1.98 GHz boost
    ],
)
def test_rates_agree_with_units_times_clock(name, units, flops_per_clock, ghz, dtype):
    derived_tflops = units * flops_per_clock * ghz / 1000
    assert CATALOG.get(name).peak_tflops.get(dtype) == pytest.approx(derived_tflops, rel=0.01)


def test_nvidia_tensor_rates_are_dense_and_consistent():
    # On Ampere and newer, dense bf16 is twice dense tf32, and fp8 twice bf16 (Ada/Hopper/Blackwell).
    # A row that mixed a sparse figure with dense ones breaks one of these ratios by 2x.
    for acc in CATALOG:
        cc, p = acc.compute_capability, acc.peak_tflops
        if acc.vendor != "NVIDIA" or cc is None or cc < (8, 0):
            continue
        if p.tf32 and p.bf16:
            assert p.bf16 / p.tf32 == pytest.approx(2, rel=0.03), acc.key
        if p.fp8 and p.bf16:
            assert p.fp8 / p.bf16 == pytest.approx(2, rel=0.03), acc.key
        if p.bf16 and p.fp32:
            assert p.bf16 > p.fp32, acc.key


def test_every_row_is_sourced_and_well_formed():
    for acc in CATALOG:
        assert acc.segment in SEGMENTS
        assert re.search(r"https?://|\w+\.(com|org|net|io|ai)\b|github\.com|whitepaper", acc.source), acc.key
        assert acc.memory_bytes > 0
        for field in acc.estimated:  # an estimate is only declared for a figure that is there
            value = acc.peak_tflops.get(field) if field in DTYPES else getattr(acc, field.replace(
                "memory_gib", "memory_bytes"))
            assert value is not None, (acc.key, field)
        if acc.cloud_usd_per_hour is not None:
            assert acc.cloud_price_source and re.search(r"20\d\d", acc.cloud_price_source), acc.key
        if acc.vendor == "NVIDIA" and acc.segment != "edge":
            assert acc.compute_capability is not None, acc.key


@pytest.mark.parametrize(
    ("key", "reported_mib"),
    [
        # memory.total as nvidia-smi prints it for these cards: a vendor "GB" of GPU memory is a GiB,
        # less a little the driver reserves.
        ("h100-sxm", 81559),
        ("h200", 143771),  # seen on this project's lent H200 (device tool, KINDS.md)
        ("rtx-4090", 24564),
        ("a100-80gb-sxm", 81920),
    ],
)
def test_memory_matches_what_the_driver_reports(key, reported_mib):
    row = CATALOG.get(key)
    assert 0.99 <= reported_mib * 2**20 / row.memory_bytes <= 1.0
    assert CATALOG.match_device(row.name, reported_mib * 2**20) is row


def test_devices_are_matched_by_name_and_memory():
    assert CATALOG.match_device("NVIDIA H100 80GB HBM3", 81559 * 2**20).key == "h100-sxm"
    # The 8 GB RTX 3060 and 4060 Ti report the same names as the rows' 12 GB and 16 GB cards.
    assert CATALOG.match_device("NVIDIA GeForce RTX 3060", 8 * GiB) is None
    assert CATALOG.match_device("NVIDIA GeForce RTX 4060 Ti", 8 * GiB) is None
    assert CATALOG.match_device("NVIDIA GeForce RTX 4060 Ti", 16 * GiB - 300 * 2**20).key == "rtx-4060-ti-16gb"
    # torch names every Jetson Orin module "Orin": an 8 GB Orin Nano is not the 64 GB AGX row.
    assert CATALOG.match_device("Orin", 7.4 * GiB) is None
    assert CATALOG.match_device("Orin", 61.4 * GiB).key == "jetson-agx-orin"
    # Torch sees one MI250X die (64 GB); the row describes the two-die package.
    assert CATALOG.match_device("AMD Instinct MI250X/MI250", 64 * GiB) is None
    # Apple chips are one name for several memory sizes: matched by name.
    assert CATALOG.match_device("Apple M3 Max", 36 * GiB).key == "m3-max-40c"


@pytest.mark.parametrize(
    ("query", "key"),
    [
        ("4090", "rtx-4090"), ("rtx4090", "rtx-4090"), ("RTX 4090", "rtx-4090"), ("rtx-4090", "rtx-4090"),
        ("h100", "h100-sxm"), ("H100 SXM", "h100-sxm"), ("h100 pcie", "h100-pcie"), ("a100", "a100-40gb-sxm"),
        # Names as torch.cuda.get_device_name() / nvidia-smi / rocm-smi report them.
        ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb-sxm"), ("Tesla T4", "t4"), ("Tesla V100-SXM2-32GB", "v100-sxm2-32gb"),
        ("AMD Instinct MI300X", "mi300x"), ("Apple M3 Max", "m3-max-40c"),
    ],
)  # fmt: skip
def test_lookup_by_normalised_name_and_alias(query, key):
    assert CATALOG.get(query).key == key


def test_laptop_and_unknown_parts_do_not_match_a_desktop_row():
    assert CATALOG.find("NVIDIA GeForce RTX 4090 Laptop GPU") is None
    assert CATALOG.find("NVIDIA A100-PCIE-40GB") is None


def test_unknown_name_lists_the_closest():
    with pytest.raises(GpuwiseError) as info:
        CATALOG.get("a100 pcie")
    assert "unknown GPU 'a100 pcie'" in str(info.value)
    assert info.value.hint.startswith("closest: a100-40gb-sxm, a100-80gb-sxm")
    with pytest.raises(GpuwiseError) as info:
        CATALOG.get("A100PCIE")  # the model number inside a run-together name still leads
    assert info.value.hint.startswith("closest: a100-40gb-sxm, a100-80gb-sxm")
    with pytest.raises(GpuwiseError) as info:
        CATALOG.get("h1000")
    assert "h100-sxm" in info.value.hint


@given(st.sampled_from([a for a in CATALOG.accelerators]), st.data())
def test_any_spelling_of_an_alias_finds_its_row(acc, data):
    label = data.draw(st.sampled_from((acc.key, acc.name, *acc.aliases)))
    # Upper/lower case and separators do not matter.
    spelled = "".join(
        data.draw(st.sampled_from([c.upper(), c.lower()])) if c.isalnum() else data.draw(st.sampled_from(" -_"))
        for c in label
    )
    assert CATALOG.find(spelled) is acc


def test_normalize_name_drops_vendor_words_and_punctuation():
    assert normalize_name("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert normalize_name("AMD Instinct MI300X") == "mi300x"
    assert normalize_name("Tesla V100-SXM2-32GB") == "v100sxm232gb"


def test_filters():
    consumer = CATALOG.filter(segment="consumer")
    assert {a.segment for a in consumer} == {"consumer"} and CATALOG.get("4090") in consumer
    assert CATALOG.filter(vendor="amd") == CATALOG.filter(vendor="AMD") != []
    big = CATALOG.filter(min_memory_bytes=80 * GB)
    assert CATALOG.get("h100") in big  # 80 GiB >= 80 GB
    assert CATALOG.get("a100") not in big
    assert all(a.memory_bytes >= 80 * GB for a in big)
    with pytest.raises(GpuwiseError, match="unknown segment"):
        CATALOG.filter(segment="gaming")
    with pytest.raises(GpuwiseError, match="unknown vendor"):
        CATALOG.filter(vendor="Nvidea")


def test_to_dict_has_the_documented_json_keys():
    data = CATALOG.get("h100").to_dict()
    for key in ("name", "vendor", "segment", "memory_bytes", "memory_bandwidth_gbps", "peak_tflops", "tdp_w",
                "source"):
        assert key in data
    assert set(data["peak_tflops"]) == set(DTYPES)
    assert data["compute_capability"] == "9.0"
    assert data["peak_tflops"]["fp8"] == 1979.0
    assert CATALOG.get("t4").to_dict()["peak_tflops"]["bf16"] is None


def test_parse_catalog_rejects_clashing_aliases_and_bad_fields(tmp_catalog_text):
    assert len(parse_catalog(tmp_catalog_text)) == 1
    clash = tmp_catalog_text + tmp_catalog_text.replace('"x1"', '"x2"').replace("Example X1", "Example X2")
    with pytest.raises(ValueError, match="clashes"):
        parse_catalog(clash)
    with pytest.raises(ValueError, match="segment"):
        parse_catalog(tmp_catalog_text.replace('"datacenter"', '"gaming"'))
    with pytest.raises(ValueError, match="dtypes"):
        parse_catalog(tmp_catalog_text.replace("bf16 = 100.0", "bf17 = 100.0"))
    assert math.isclose(parse_catalog(tmp_catalog_text).get("x1 sxm").peak_tflops.bf16, 100.0)
