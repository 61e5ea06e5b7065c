"""The catalog against datasheet figures and first-principles derivations, and its look-up rules."""

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwise.errors import GpuwiseError
from gpuwise.hardware.catalog import DTYPES, ECOSYSTEMS, SEGMENTS, load_catalog, normalize_name, parse_catalog
from gpuwise.units import GB, GiB

CATALOG = load_catalog()

# The rows the catalog must have, by a name a user would type.
REQUIRED = [
    "RTX 3060 12GB", "RTX 4060 Ti 16GB", "RTX 3090", "RTX 4090", "RTX 5090", "RTX 6000 Ada",
    "RTX PRO 6000 Blackwell", "T4", "V100", "A10", "A100 40GB", "A100 80GB", "L4", "L40S", "H100 SXM",
    "H100 PCIe", "H200", "B200", "GB200", "MI250X", "MI300X", "MI325X", "Gaudi 2", "Gaudi 3",
    "Ascend 910B", "TPU v5e", "TPU v5p", "M2 Ultra", "M3 Max", "M4 Max", "Jetson AGX Orin", "Coral Edge TPU",
    # issue 12 (recommend): rows a ranking across clouds, workstations and phones needs
    "A10G", "A100 40GB PCIe", "L40", "RTX 4000 Ada", "RTX 5000 Ada", "H20", "Apple Neural Engine", "Hexagon NPU",
    # issue 26 (speed model): NeuSight's training GPUs and the A100 80GB PCIe it measured convolutions on
    "A100 80GB PCIe", "V100 PCIe", "P100", "P4",
]  # fmt: skip


def test_catalog_has_every_required_row_and_at_least_30():
    assert len(CATALOG) >= 51
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
        ("NVIDIA A10G", "a10g"), ("a10", "a10"), ("NVIDIA A100-PCIE-40GB", "a100-40gb-pcie"), ("NVIDIA L40", "l40"),
        ("l40s", "l40s"), ("NVIDIA H20", "h20"), ("h200", "h200"), ("NVIDIA RTX 4000 Ada Generation", "rtx-4000-ada"),
        ("rtx 5000 ada", "rtx-5000-ada"), ("snapdragon x elite", "hexagon-x-elite"), ("Qualcomm Hexagon NPU",
        "hexagon-x-elite"), ("m4 neural engine", "apple-ane-m4"),
        # NeuSight's device names (its data README), as torch.cuda.get_device_name() prints them
        ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"), ("Tesla V100-PCIE-32GB", "v100-pcie-32gb"),
        ("Tesla P100-PCIE-16GB", "p100-pcie-16gb"), ("Tesla P4", "p4"), ("v100", "v100-sxm2-32gb"),
    ],
)  # fmt: skip
def test_lookup_by_normalised_name_and_alias(query, key):
    assert CATALOG.get(query).key == key


def test_laptop_and_unknown_parts_do_not_match_a_desktop_row():
    assert CATALOG.find("NVIDIA GeForce RTX 4090 Laptop GPU") is None
    # the 80 GB PCIe card is its own row, neither the 40 GB PCIe nor the 80 GB SXM one
    assert CATALOG.find("NVIDIA A100 80GB PCIe").key == "a100-80gb-pcie"
    assert CATALOG.find("NVIDIA RTX 4000 SFF Ada Generation") is None  # the 70 W card is not the 130 W one
    # The M4's GPU (what torch's MPS device names) is not its Neural Engine.
    assert CATALOG.find("Apple M4") is None


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


# The fields issue 12 made required, added to conftest's one-row catalog.
_RECOMMEND_FIELDS = 'ecosystem = "cuda"\nnode_gpus = 8\n'


@pytest.fixture
def row_text(tmp_catalog_text) -> str:
    return tmp_catalog_text.replace('source = ', _RECOMMEND_FIELDS + 'source = ')


def test_parse_catalog_rejects_clashing_aliases_and_bad_fields(row_text):
    assert len(parse_catalog(row_text)) == 1
    clash = row_text + row_text.replace('"x1"', '"x2"').replace("Example X1", "Example X2")
    with pytest.raises(ValueError, match="clashes"):
        parse_catalog(clash)
    with pytest.raises(ValueError, match="segment"):
        parse_catalog(row_text.replace('"datacenter"', '"gaming"'))
    with pytest.raises(ValueError, match="dtypes"):
        parse_catalog(row_text.replace("bf16 = 100.0", "bf17 = 100.0"))
    assert math.isclose(parse_catalog(row_text).get("x1 sxm").peak_tflops.bf16, 100.0)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (('ecosystem = "cuda"', 'ecosystem = "opencl"'), "catalog row 'x1': ecosystem 'opencl' is not one of"),
        (('ecosystem = "cuda"\n', ""), "catalog row 'x1': missing 'ecosystem'"),
        (("node_gpus = 8", "node_gpus = 0"), "catalog row 'x1': node_gpus 0 must be a whole number >= 1"),
        (("node_gpus = 8", "node_gpus = 2.5"), "node_gpus 2.5 must be a whole number"),
        (("node_gpus = 8\n", ""), "missing 'node_gpus'"),
        (("source = ", 'cloud_usd_per_hour = -1.5\ncloud_price_source = "x"\ncloud_price_date = "2026-05"\nsource = '),
         "catalog row 'x1': cloud_usd_per_hour -1.5 must be a number > 0"),
        (("source = ", "launch_price_usd = 0\nsource = "), "launch_price_usd 0 must be a number > 0"),
        (("source = ", 'cloud_usd_per_hour = 1.5\ncloud_price_source = "x"\nsource = '),
         r"cloud_usd_per_hour needs \['cloud_price_date'\]"),
        (("source = ", 'cloud_usd_per_hour = 1.5\ncloud_price_date = "2026-05"\nsource = '),
         r"cloud_usd_per_hour needs \['cloud_price_source'\]"),
        (("source = ", 'cloud_usd_per_hour = 1.5\ncloud_price_source = "x"\ncloud_price_date = "May 2026"\nsource = '),
         "cloud_price_date 'May 2026' is not a month 'YYYY-MM'"),
        (("source = ", 'street_price_usd = 700\nstreet_price_source = "x"\nstreet_price_date = "2026-13"\nsource = '),
         "street_price_date '2026-13' is not a month"),
        (("source = ", 'cloud_price_date = "2026-05"\nsource = '), "given without 'cloud_usd_per_hour'"),
        (("source = ", "allreduce_busbw_gbps = 480\nsource = "), r"allreduce_busbw_gbps needs \['allreduce_source'\]"),
        (("source = ", 'cloud_price_data = "2026-05"\nsource = '), "did you mean 'cloud_price_date'"),
        (("source = ", "sm_count = 132.5\nsource = "), "catalog row 'x1': sm_count 132.5 must be a whole number"),
        (("source = ", "sm_count = -4\nsource = "), "sm_count -4 must be a number > 0"),
        (("source = ", "l2_mib = 0\nsource = "), "l2_mib 0 must be a number > 0"),
        (("source = ", "base_clock_mhz = 1980\nboost_clock_mhz = 1590\nsource = "),
         "base_clock_mhz 1980 is above boost_clock_mhz 1590"),
        (("source = ", "sm_clock = 1980\nsource = "), "unknown keys"),
    ],
)  # fmt: skip
def test_malformed_rows_raise_a_clear_value_error(row_text, edit, message):
    bad = row_text.replace(*edit)
    assert bad != row_text, edit
    with pytest.raises(ValueError, match=message):
        parse_catalog(bad)


def test_every_row_has_a_known_ecosystem_and_a_sane_node():
    for acc in CATALOG:
        assert acc.ecosystem in ECOSYSTEMS, acc.key
        assert isinstance(acc.node_gpus, int) and 1 <= acc.node_gpus <= 72, acc.key
        assert re.search(rf"node_gpus {acc.node_gpus}: \w", acc.source), acc.key  # the reason is in the source
        if acc.node_gpus == 1:
            assert acc.allreduce_busbw_gbps is None, acc.key  # nothing to all-reduce across
    by_vendor = {"AMD": {"rocm"}, "Huawei": {"cann"}, "Google": {"xla", "edgetpu"}, "Intel": {"gaudi"},
                 "Apple": {"mps", "coreml"}, "Qualcomm": {"qnn"}, "NVIDIA": {"cuda"}}
    for acc in CATALOG:
        assert acc.ecosystem in by_vendor[acc.vendor], acc.key
    expected = {"gb200": 72, "h100-sxm": 8, "h100-pcie": 2, "mi300x": 8, "m4-max-40c": 1}
    assert {key: CATALOG.get(key).node_gpus for key in expected} == expected
    # NPUs and the Edge TPU run exported graphs, Apple GPUs run MPS, TPUs need torch_xla.
    assert CATALOG.get("Apple Neural Engine").ecosystem == "coreml"
    assert CATALOG.get("Hexagon NPU").ecosystem == "qnn"
    assert CATALOG.get("tpu v5e").ecosystem == "xla" and CATALOG.get("910b").ecosystem == "cann"


def test_npu_rows_hold_only_published_figures():
    for name, tops, memory_gb, gbps in [("Apple Neural Engine", 38, 32, 120), ("Hexagon NPU", 45, 64, 136)]:
        npu = CATALOG.get(name)
        assert npu.segment == "edge" and npu.node_gpus == 1 and not npu.peer_link
        assert npu.peak_tflops.int8 == tops  # Apple M4 keynote: 38 TOPS; Qualcomm: 45 TOPS
        assert [npu.peak_tflops.get(d) for d in DTYPES if d != "int8"] == [None] * 5
        assert (npu.memory_bytes, npu.memory_bandwidth_gbps) == (memory_gb * GiB, gbps)
        assert npu.tdp_w is None and npu.cloud_usd_per_hour is None  # nobody publishes them
    assert CATALOG.get("Hexagon NPU").vendor == "Qualcomm"
    assert CATALOG.filter(vendor="qualcomm") == [CATALOG.get("hexagon-x-elite")]


def test_every_price_has_a_source_and_a_month():
    priced = 0
    for acc in CATALOG:
        for price, source, date in [
            (acc.cloud_usd_per_hour, acc.cloud_price_source, acc.cloud_price_date),
            (acc.street_price_usd, acc.street_price_source, acc.street_price_date),
        ]:
            if price is None:
                assert source is None and date is None, acc.key
                continue
            priced += 1
            assert price > 0 and source and re.fullmatch(r"20\d\d-(0[1-9]|1[0-2])", date), acc.key
            # the year of the stated month appears in the source text
            assert date[:4] in source, (acc.key, source)
        if acc.launch_price_usd is not None:
            assert acc.launch_price_usd > 0 and acc.launch_year is not None, acc.key
    assert priced >= 19  # 17 cloud prices and 2 street prices found with dated sources (May-June 2026 search)
    # A10G: AWS g5.xlarge in us-east-1, $1.006/h on demand (June 2026).
    a10g = CATALOG.get("A10G")
    assert (a10g.cloud_usd_per_hour, a10g.cloud_price_date) == (1.006, "2026-06")


# Published NCCL all_reduce_perf bus bandwidths, GB/s, as quoted in the recommend anchors
# (/work/shared/reference/recommend-watch-anchors.md, "Published NCCL bus bandwidths"): (low, high) per key.
PUBLISHED_BUSBW = {
    "h100-sxm": (480, 480),  # 8x H100 SXM, NVLS: "peak busBw of ~480GB/s" (nccl-tests#212; ring ~370)
    "h200": (475, 475),  # 8x H200 SXM (nccl-tests#272)
    "a100-80gb-sxm": (200, 208),  # 8x A100 SXM4 80GB: ~200 (nccl-tests#149), 208 (#178)
    "h100-pcie": (115, 116),  # 2x H100 PCIe with an NVLink bridge (nccl#1161)
    "rtx-4090": (25.7, 26.0),  # 4x RTX 4090, PCIe 4.0, P2P via the tinygrad kernel module (tinygrad#36)
    "rtx-5090": (35, 35),  # 4x RTX 5090, PCIe 5.0, ACS off (nccl#1639; 8 cards: 28)
}
PUBLISHED_NODE = {"h100-sxm": 8, "h200": 8, "a100-80gb-sxm": 8, "h100-pcie": 2, "rtx-4090": 4, "rtx-5090": 4}


def test_busbw_figures_are_the_published_measurements_and_nothing_else():
    measured = {a.key: a for a in CATALOG if a.allreduce_busbw_gbps is not None}
    assert set(measured) == set(PUBLISHED_BUSBW)  # no row carries an invented figure
    for key, (low, high) in PUBLISHED_BUSBW.items():
        acc = measured[key]
        assert low <= acc.allreduce_busbw_gbps <= high, key
        assert acc.node_gpus == PUBLISHED_NODE[key], key  # the figure is for a node of node_gpus cards
        assert re.search(r"NVIDIA/nccl|tinygrad/", acc.allreduce_source), key
    # A bus bandwidth cannot exceed the link's one-way rate (interconnect_gbps is bidirectional).
    for acc in measured.values():
        assert acc.allreduce_busbw_gbps <= acc.interconnect_gbps / 2 * 1.1, acc.key


def test_new_rows_match_their_datasheets():
    # NVIDIA L40 datasheet: 48 GB, 864 GB/s, 300 W, BF16 362.1 TFLOPS with sparsity -> 181.05 dense.
    l40 = CATALOG.get("l40")
    assert (l40.memory_bytes, l40.memory_bandwidth_gbps, l40.tdp_w) == (48 * GiB, 864, 300)
    assert l40.peak_tflops.bf16 == pytest.approx(362.1 / 2)
    assert CATALOG.get("l40s").peak_tflops.bf16 == pytest.approx(2 * l40.peak_tflops.bf16, rel=0.01)
    # A100 40GB PCIe: SXM compute at 250 W, with a 2-card NVLink bridge.
    pcie, sxm = CATALOG.get("a100 40gb pcie"), CATALOG.get("a100")
    assert pcie.peak_tflops == sxm.peak_tflops and pcie.memory_bytes == sxm.memory_bytes
    assert (pcie.tdp_w, pcie.node_gpus, sxm.node_gpus) == (250, 2, 8)
    # H20: a sixth of the H100's dense bf16, more bandwidth.
    h20, h100 = CATALOG.get("h20"), CATALOG.get("h100")
    assert h20.peak_tflops.bf16 == 148 and h20.memory_bandwidth_gbps > h100.memory_bandwidth_gbps
    # RTX Ada workstation cards: tensor TFLOPS printed with sparsity at FP8 (327.6 and 1,044.4) -> bf16 = /4.
    assert CATALOG.get("rtx 4000 ada").peak_tflops.bf16 == pytest.approx(327.6 / 4, rel=0.001)
    assert CATALOG.get("rtx 5000 ada").peak_tflops.bf16 == pytest.approx(1044.4 / 4, rel=0.001)
    # A10G: PyTorch measures 69.5 TFLOPS bf16 (torch-performance-test-data#126): near the stored 70, not the A10's 125.
    assert CATALOG.get("a10g").peak_tflops.bf16 == pytest.approx(69.47, rel=0.02)
    assert CATALOG.get("a10").peak_tflops.bf16 == 125.0


def test_to_dict_carries_the_recommend_fields():
    data = CATALOG.get("h100").to_dict()
    assert data["ecosystem"] == "cuda" and data["node_gpus"] == 8
    assert data["allreduce_busbw_gbps"] == 480 and "nccl-tests#212" in data["allreduce_source"]
    assert data["cloud_price_date"] == "2026-05"
    assert data["street_price_usd"] is None and data["street_price_source"] is None
    assert CATALOG.get("4090").to_dict()["street_price_date"] == "2026-02"


# FP32 lanes per SM (AMD: FP32 FLOPs per clock per CU / 2), by the chip named in a row's `arch`. Sources:
# GP100 64 (NVIDIA Tesla P100 / Pascal GP100 whitepaper); GP104 128 (GeForce GTX 1080 whitepaper); GV100 64 (Volta
# whitepaper); TU104 64 (Turing whitepaper); GA100 64 (A100 whitepaper); GA10x 128 (GA102 whitepaper: the GA10x SM
# doubles FP32); AD10x 128 (Ada whitepaper); GH100 128 (H100 whitepaper); Blackwell 128 (GB202 whitepaper; B200
# 148 SMs x 128 = 18,944 cores); CDNA 2 64 (CDNA 2 whitepaper: 128 FP32 vector FLOP/clk/CU, packed FP32 doubles it
# and AMD lists that as 95.7 "matrix"); CDNA 3 and CDNA 4 128 (CDNA 3/4 whitepapers: 256 FP32 FLOP/clk/CU); RDNA 3
# (gfx11) and RDNA 4 (gfx12) 128 (64 stream processors per CU, dual-issued: AMD's 61.4 TFLOPS for the 7900 XTX is
# 96 CUs x 256 FLOP/clk x 2.5 GHz).
FP32_LANES_PER_SM = {"GP100": 64, "GP104": 128, "GV100": 64, "TU104": 64, "GA100": 64, "GA10": 128, "AD10": 128,
                     "GH100": 128, "GB": 128, "gfx90a": 64, "gfx942": 128, "gfx950": 128, "gfx11": 128, "gfx12": 128}
# Rows whose stored fp32 is not the SMs x clock x lanes product, and why; each must really disagree.
FP32_EXEMPT = {"h20": "third-party FP32 44 with 78 SMs needs 2.2 GHz; no clock is published (boost assumed)"}


def _lanes_per_sm(arch: str) -> int:
    chip = re.search(r"\((\w+)", arch).group(1)
    prefixes = [p for p in FP32_LANES_PER_SM if chip.startswith(p)]
    assert prefixes, f"no FP32 lane count for chip {chip!r} ({arch}); add it to FP32_LANES_PER_SM with its source"
    return FP32_LANES_PER_SM[max(prefixes, key=len)]


def _gpu_rows():
    return [a for a in CATALOG if a.vendor in ("NVIDIA", "AMD")]


def test_every_nvidia_and_amd_row_has_its_chip_facts():
    rows = _gpu_rows()
    assert len(rows) == 65  # 55 NVIDIA (the Jetson and the DGX Spark included) and 10 AMD (4 Instinct, 6 Radeon)
    for acc in rows:
        assert isinstance(acc.sm_count, int) and acc.sm_count > 0, acc.key
        assert acc.boost_clock_mhz and 500 < acc.boost_clock_mhz < 3000, acc.key
        if acc.base_clock_mhz is not None:
            assert 0 < acc.base_clock_mhz < acc.boost_clock_mhz, acc.key
        if acc.l2_mib is not None:
            assert 1 <= acc.l2_mib <= 256, acc.key
        assert re.search(r"[Cc]hip facts", acc.source), acc.key  # the source says where they come from
    # Only the H20 and the DGX Spark's GB10 lack a published L2 size.
    assert [a.key for a in rows if a.l2_mib is None] == ["dgx-spark", "h20"]
    # Other vendors' chips have no SM equivalent the speed model could use: left out, not guessed.
    assert all(a.sm_count is None and a.boost_clock_mhz is None for a in CATALOG if a not in rows)


@pytest.mark.parametrize("acc", _gpu_rows(), ids=lambda a: a.key)
def test_fp32_rate_reproduces_from_sms_clock_and_lanes(acc):
    # peak fp32 = SMs x FP32 lanes per SM x 2 (FMA) x boost clock: the datasheet figure within 3%.
    derived_tflops = acc.sm_count * _lanes_per_sm(acc.arch) * 2 * acc.boost_clock_mhz / 1e6
    if acc.key in FP32_EXEMPT:
        assert derived_tflops != pytest.approx(acc.peak_tflops.fp32, rel=0.03), FP32_EXEMPT[acc.key]
        assert "boost_clock_mhz" in acc.estimated
        return
    assert derived_tflops == pytest.approx(acc.peak_tflops.fp32, rel=0.03)


@pytest.mark.parametrize(
    ("key", "cuda_cores"),
    [
        # CUDA cores as the vendor prints them (the rows' sources): SMs x FP32 lanes must give them.
        ("p4", 2560), ("t4", 2560), ("p100-pcie-16gb", 3584), ("v100-pcie-32gb", 5120), ("a100-40gb-pcie", 6912),
        ("a100-80gb-pcie", 6912), ("rtx-3060-12gb", 3584), ("rtx-4090", 16384), ("rtx-5090", 21760),
        ("rtx-pro-6000", 24064), ("l4", 7424), ("h100-sxm", 16896), ("h100-pcie", 14592), ("b200", 18944),
        ("jetson-agx-orin", 2048), ("mi250x", 14080),  # MI250X: AMD's 14,080 stream processors = 220 CUs x 64
        # issue 27's consumer rows, cores as NVIDIA's spec pages print them (AMD: stream processors x 2, dual issue)
        ("rtx-3080", 8704), ("rtx-3090-ti", 10752), ("rtx-4070", 5888), ("rtx-4070-ti-super", 8448),
        ("rtx-5060-ti-16gb", 4608), ("rtx-5070", 6144), ("rtx-5070-ti", 8960), ("rtx-5050", 2560),
        ("dgx-spark", 6144), ("rx-7900-xtx", 2 * 6144), ("rx-9070-xt", 2 * 4096),
    ],
)  # fmt: skip
def test_sms_times_lanes_is_the_published_core_count(key, cuda_cores):
    acc = CATALOG.get(key)
    assert acc.sm_count * _lanes_per_sm(acc.arch) == cuda_cores


def test_neusight_gpus_resolve_by_their_device_names_with_the_true_sm_counts():
    # NeuSight (sitar-lab/NeuSight) trained on these five names (its README; A100 80GB PCIe for conv).
    names = {"Tesla P4": "p4", "Tesla T4": "t4", "Tesla P100-PCIE-16GB": "p100-pcie-16gb",
             "Tesla V100-PCIE-32GB": "v100-pcie-32gb", "NVIDIA A100-PCIE-40GB": "a100-40gb-pcie",
             "NVIDIA A100 80GB PCIe": "a100-80gb-pcie"}
    assert {name: CATALOG.get(name).key for name in names} == names
    # NeuSight's device table (SMs, MHz): P4 40/1113, T4 40/1590, P100 56/1380, V100 80/1370, A100 108/1410.
    # It counts the P4's 2,560 GP104 lanes as 40 SMs of 64; GP104 has 20 SMs of 128 (GTX 1080 whitepaper,
    # TechPowerUp): the same FLOP rate, half the SMs, which is what a wave count over the SMs needs.
    p4 = CATALOG.get("Tesla P4")
    assert p4.sm_count == 20 and 20 * 128 == 40 * 64
    assert "NeuSight" in p4.source and "40 SMs" in p4.source
    assert {k: CATALOG.get(k).sm_count for k in ("t4", "p100-pcie-16gb", "v100-pcie-32gb", "a100-40gb-pcie")} == {
        "t4": 40, "p100-pcie-16gb": 56, "v100-pcie-32gb": 80, "a100-40gb-pcie": 108}
    # Clocks: NVIDIA's, with NeuSight's differing figures noted in the source.
    assert CATALOG.get("p100-pcie-16gb").boost_clock_mhz == 1303 and "1,380" in CATALOG.get("p100").source
    assert p4.boost_clock_mhz == 1063 and "1,113" in p4.source


def test_speed_model_rows_match_their_datasheets():
    # A100 80GB PCIe (nvidia.com/en-us/data-center/a100): SXM compute, 80 GB HBM2e at 1,935 GB/s, 300 W.
    a100, sxm = CATALOG.get("a100-80gb-pcie"), CATALOG.get("a100-80gb-sxm")
    assert (a100.memory_bytes, a100.memory_bandwidth_gbps, a100.tdp_w) == (80 * GiB, 1935, 300)
    assert a100.peak_tflops == sxm.peak_tflops and a100.node_gpus == 2 and a100.compute_capability == (8, 0)
    assert (a100.sm_count, a100.boost_clock_mhz, a100.l2_mib) == (108, 1410, 40)
    # mixbench on this card (ekondis/mixbench#47): "NVIDIA A100 80GB PCIe", 81,049 MiB.
    assert CATALOG.match_device("NVIDIA A100 80GB PCIe", 81049 * 2**20) is a100
    # V100 PCIe (V100 datasheet): FP32 14, tensor 112, 900 GB/s, 250 W; no bf16/tf32.
    v100 = CATALOG.get("Tesla V100-PCIE-32GB")
    assert (v100.peak_tflops.fp32, v100.peak_tflops.fp16, v100.memory_bandwidth_gbps, v100.tdp_w) == (14, 112, 900, 250)
    assert (v100.sm_count, v100.boost_clock_mhz) == (80, 1380) and not v100.bf16 and v100.peak_tflops.tf32 is None
    assert v100.peak_tflops.fp16 == pytest.approx(640 * 128 * 1.380 / 1000, rel=0.01)  # 640 tensor cores x 64 FMA
    # P100 PCIe (datasheet): FP32 9.3, FP16 18.7 as packed half on the CUDA cores, 732 GB/s, 250 W.
    p100 = CATALOG.get("Tesla P100-PCIE-16GB")
    assert (p100.peak_tflops.fp32, p100.peak_tflops.fp16, p100.memory_bandwidth_gbps, p100.tdp_w) == (
        9.3, 18.7, 732, 250)
    assert p100.peak_tflops.fp16 == pytest.approx(2 * p100.peak_tflops.fp32, rel=0.01)
    assert [p100.peak_tflops.get(d) for d in ("tf32", "bf16", "fp8", "int8")] == [None] * 4
    assert (p100.sm_count, p100.boost_clock_mhz, p100.compute_capability) == (56, 1303, (6, 0))
    # P4 (datasheet): FP32 5.5, INT8 22 TOPS (DP4A: 4x fp32), 8 GB GDDR5 at 192 GB/s, 75 W; no usable fp16.
    p4 = CATALOG.get("Tesla P4")
    assert (p4.peak_tflops.fp32, p4.peak_tflops.int8, p4.memory_bandwidth_gbps, p4.tdp_w) == (5.5, 22, 192, 75)
    assert p4.peak_tflops.int8 == pytest.approx(4 * p4.peak_tflops.fp32, rel=0.01) and p4.peak_tflops.fp16 is None
    assert (p4.memory_bytes, p4.compute_capability, p4.l2_mib) == (8 * GiB, (6, 1), 2)
    for acc in (a100, v100, p100, p4):
        assert acc.ecosystem == "cuda" and acc.segment == "datacenter" and acc.launch_year is not None
        assert acc.interconnect and acc.host_link and acc.cloud_usd_per_hour is None  # no dated price was found


def test_chip_facts_match_whitepapers_and_device_queries():
    # (SMs, boost MHz, L2 MiB): A100 whitepaper; H100 whitepaper (SXM5); Ada appendix (RTX 4090); GA102
    # appendix (RTX 3090); T4 (Turing whitepaper, TechPowerUp); B200 device query (pytorch/ao#4002);
    # MI300X CDNA 3 whitepaper (304 CUs, 2.1 GHz, 256 MB Infinity Cache as the last level).
    expected = {"a100-40gb-sxm": (108, 1410, 40), "h100-sxm": (132, 1980, 50), "rtx-4090": (128, 2520, 72),
                "rtx-3090": (82, 1695, 6), "t4": (40, 1590, 4), "b200": (148, 1980, 126.5),
                "mi300x": (304, 2100, 256)}
    got = {k: (CATALOG.get(k).sm_count, CATALOG.get(k).boost_clock_mhz, CATALOG.get(k).l2_mib) for k in expected}
    assert got == expected
    assert "Infinity Cache" in CATALOG.get("mi300x").source  # the source says which cache l2_mib is
    data = CATALOG.get("a100").to_dict()
    assert (data["sm_count"], data["boost_clock_mhz"], data["base_clock_mhz"], data["l2_mib"]) == (108, 1410, 1095, 40)
    assert CATALOG.get("tpu v5e").to_dict()["sm_count"] is None


def test_issue27_consumer_rows_match_their_spec_pages():
    # (memory GiB, GB/s, W, boost MHz, launch $) as the vendors' spec pages print them.
    expected = {
        "rtx-3080": (10, 760, 320, 1710, 699), "rtx-4070": (12, 504, 200, 2475, 599),
        "rtx-5060-ti-16gb": (16, 448, 180, 2572, 429), "rtx-5060-ti-8gb": (8, 448, 180, 2572, 379),
        "rtx-5070-ti": (16, 896, 300, 2452, 749), "rx-7900-xtx": (24, 960, 355, 2500, 999),
        "rx-9070-xt": (16, 640, 304, 2970, 599), "dgx-spark": (128, 273, 140, 2523, 3999),
    }
    got = {k: (CATALOG.get(k).memory_bytes / GiB, CATALOG.get(k).memory_bandwidth_gbps, CATALOG.get(k).tdp_w,
               CATALOG.get(k).boost_clock_mhz, CATALOG.get(k).launch_price_usd) for k in expected}
    assert got == expected
    # GA102 appendix, RTX 3080: 59.5 dense FP16/BF16 with FP32 accumulate; Ada appendix "RTX 4080 12GB" = 4070 Ti: 80.2.
    assert (CATALOG.get("3080").peak_tflops.bf16, CATALOG.get("4070 ti").peak_tflops.bf16) == (59.5, 80.2)
    # GeForce Blackwell: SMs x boost x 8,192 is the spec page's "AI TOPS" (FP4 sparse), 16 x the stored bf16.
    for key, ai_tops in {"rtx-5050": 421, "rtx-5060": 614, "rtx-5060-ti-16gb": 759, "rtx-5070": 988,
                         "rtx-5070-ti": 1406, "rtx-5080": 1801}.items():
        acc = CATALOG.get(key)
        assert acc.sm_count * acc.boost_clock_mhz * 8192 / 1e6 == pytest.approx(ai_tops, rel=0.005), key
        assert 16 * acc.peak_tflops.bf16 == pytest.approx(ai_tops, rel=0.005), key
    # AMD: 7900 XTX peak FP32 61.4 and FP16 122.8 (RDNA 3, no sparsity); 9070 XT INT8 779 TOPS with sparsity = 2x dense.
    xtx, rdna4 = CATALOG.get("RX 7900 XTX"), CATALOG.get("9070 xt")
    assert xtx.peak_tflops.fp32 == pytest.approx(61.4, abs=0.05)
    assert xtx.peak_tflops.bf16 == pytest.approx(122.8, abs=0.15)
    assert 2 * rdna4.peak_tflops.int8 == pytest.approx(779, rel=0.002) and xtx.peak_tflops.fp8 is None
    # The 8 GB cards answer to their own key; the shared device name stays with the 16 GB rows.
    assert CATALOG.get("rtx 5060 ti").key == "rtx-5060-ti-16gb"
    assert CATALOG.get("rtx 4060 ti 8gb").memory_bytes == 8 * GiB
    assert CATALOG.find("NVIDIA GB10").key == "dgx-spark"  # torch's name for the Spark's GPU (dgx_spark_config#1)
