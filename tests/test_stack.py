"""Compatibility rules against NVIDIA's and PyTorch's published tables (shared/reference/stack-compat.md)."""

import pytest

from gpuwise.stack import (
    arch_coverage,
    choose_wheel,
    driver_max_cuda,
    driver_need,
    first_cuda_for,
    format_version,
    has_sass,
    parse_version,
    wheel_archs,
)


def test_parse_version():
    assert parse_version("580.82.07") == (580, 82, 7)
    assert parse_version("2.13.0+cu130") == (2, 13, 0)
    assert parse_version("2.6.0a0+git1234") == (2, 6)
    assert format_version((580, 65, 6)) == "580.65.06"  # NVIDIA writes the parts after the branch
    assert format_version((576, 2)) == "576.02"  # with two digits, on Linux and Windows alike


@pytest.mark.parametrize(
    ("driver", "cuda"),
    [
        # nvidia-smi header "CUDA Version" seen with these drivers (Table 3 GA rows).
        ("470.82.01", (11, 4)),  # torch's "found version 11040"
        ("535.104.05", (12, 2)),
        ("550.54.14", (12, 4)),
        ("565.57.01", (12, 6)),  # R565 is not a toolkit branch: it supports the one below
        ("570.124.06", (12, 8)),
        ("580.82.07", (13, 0)),
        ("595.58.03", (13, 2)),
    ],
)
def test_driver_max_cuda_decodes_branches(driver, cuda):
    assert driver_max_cuda(parse_version(driver)) == cuda


def test_driver_need_follows_minor_version_compatibility():
    # CUDA 12.x runs on >= 525.60.13 (Linux) / 527.41 (Windows); its own toolkit driver is newer.
    assert driver_need((12, 8), "Linux").floor == (525, 60, 13)
    assert driver_need((12, 8), "Linux").toolkit_driver == (570, 26)
    assert driver_need((12, 6), "Windows").floor == (527, 41)
    assert driver_need((13, 0), "Linux").floor == (580, 65, 6)
    assert driver_need((11, 8), "Linux").floor == (450, 80, 2)
    # Windows stopped bundling a driver with 13.x: the R580 branch stands in.
    assert (560, 94) < driver_need((13, 0), "Windows").floor <= (580, 88) <= (581, 57)


def test_first_cuda_for_an_architecture_covers_every_minor_of_a_major():
    assert first_cuda_for((9, 0)) == (11, 8)
    assert first_cuda_for((10, 3)) == (12, 8)  # B300
    assert first_cuda_for((12, 1)) == (12, 8)  # GB10
    assert first_cuda_for((8, 9)) == (11, 8)
    assert first_cuda_for((8, 6)) is None


def test_sass_compatibility_rule():
    cu126 = wheel_archs((2, 13), "cu126")
    assert has_sass((8, 9), cu126)  # Ada runs sm_86 code: PyTorch lists no sm_89 on purpose
    assert has_sass((8, 7), cu126)  # Orin
    assert not has_sass((12, 0), cu126)  # RTX 50 needs cu128+
    assert not has_sass((10, 0), wheel_archs((2, 6), "cu126"))
    assert has_sass((12, 0), wheel_archs((2, 7), "cu128"))


def test_wheel_archs_track_the_volta_and_pascal_history():
    assert (7, 0) not in wheel_archs((2, 7), "cu128")
    assert (7, 0) in wheel_archs((2, 9), "cu128")
    assert (7, 0) not in wheel_archs((2, 11), "cu128")
    assert (6, 0) not in wheel_archs((2, 13), "cu130")
    assert (7, 0) not in wheel_archs((2, 13), "cu130")
    assert (6, 0) in wheel_archs((2, 13), "cu126")


@pytest.mark.parametrize(
    ("cc", "archs", "coverage"),
    [
        ((8, 9), ("sm_80", "sm_86"), "sass"),  # same major, lower minor: native
        ((9, 0), ("sm_80", "sm_86"), None),  # SASS never crosses a major
        ((12, 0), ("sm_90", "compute_90"), "ptx"),  # PTX is JIT-compiled for newer GPUs
        ((9, 0), ("sm_90a",), "sass"),  # arch-specific code runs on exactly that arch
        ((10, 3), ("sm_100a",), None),  # ... and not on a later minor
        ((10, 3), ("sm_100f",), "sass"),  # family-specific code runs across the family
        ((10, 0), ("compute_100a",), None),  # arch-specific PTX is not forward-portable either
        ((9, 0), ("gfx942",), None),
    ],
)
def test_arch_coverage(cc, archs, coverage):
    assert arch_coverage(cc, archs) == coverage


@pytest.mark.parametrize(
    ("driver", "cc", "index"),
    [
        ((580, 82, 7), (9, 0), "cu130"),  # full compatibility preferred over minor-version (cu132)
        ((595, 58, 3), (9, 0), "cu132"),
        ((550, 54, 14), (8, 9), "cu126"),  # R550 runs 12.6 through minor-version compatibility
        ((580, 82, 7), (7, 0), "cu126"),  # V100 is only in cu126 from 2.11 on
        ((580, 82, 7), (6, 1), "cu126"),  # Pascal likewise
        ((580, 82, 7), (12, 0), "cu130"),
    ],
)
def test_choose_wheel(driver, cc, index):
    choice = choose_wheel("2.13.0+cpu", driver=driver, capabilities=(cc,))
    assert choice is not None and choice.index == index
    assert choice.command == f"pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/{index}"


def test_choose_wheel_on_windows_respects_the_r580_branch_for_cu13x():
    choice = choose_wheel("2.13.0", driver=(560, 94), capabilities=((8, 9),), os_name="Windows")
    assert choice is not None and choice.index == "cu126"
    assert choose_wheel("2.13.0", driver=(581, 57), capabilities=((8, 9),), os_name="Windows").index == "cu130"


def test_choose_wheel_gives_no_advice_for_releases_it_has_no_table_for():
    assert choose_wheel("2.3.1", driver=(550, 54), capabilities=((8, 0),)) is None
    assert choose_wheel("garbage", driver=(550, 54), capabilities=((8, 0),)) is None
    # 2.15 (planned) drops cu126: a V100 has no 2.15 wheel.
    assert choose_wheel("2.15.0", driver=(580, 82, 7), capabilities=((7, 0),)) is None


def test_choose_wheel_gives_none_when_nothing_fits():
    # An RTX 5090 on an R550 driver: the only wheels with sm_120 need >= 580 (cu13x) on torch 2.13.
    assert choose_wheel("2.13.0", driver=(550, 54, 14), capabilities=((12, 0),)) is None
    # A K80 (sm_37) has no wheel at all in 2.13.
    assert choose_wheel("2.13.0", driver=(470, 82), capabilities=((3, 7),)) is None
