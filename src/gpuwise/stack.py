"""Facts about the PyTorch / CUDA / driver stack that ``doctor`` checks against.

Sources (stored copies, see shared/reference/stack-compat.md):
- NVIDIA CUDA Toolkit Release Notes, Table 3 (toolkit -> driver it ships with) and Table 2 (minimum
  driver for minor-version compatibility):
  https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/index.html
- CUDA Compatibility guide: https://docs.nvidia.com/deploy/cuda-compatibility/index.html
- PyTorch RELEASE.md "Release Compatibility Matrix" and ``.ci/manywheel/build_cuda.sh``
  (``TORCH_CUDA_ARCH_LIST`` of the official Linux x86_64 wheels).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

Version = tuple[int, ...]

# CUDA toolkit -> (Linux, Windows) driver shipped with it (Table 3, GA rows). Windows stopped
# bundling the display driver with 13.x, so NVIDIA gives no Windows figure from then on; there the
# driver branch stands in (a one-part version: every R580 Windows driver is 580.xx or newer).
TOOLKIT_DRIVER: dict[tuple[int, int], tuple[Version, Version]] = {
    (11, 8): ((520, 61, 5), (520, 6)),
    (12, 0): ((525, 60, 13), (527, 41)),
    (12, 1): ((530, 30, 2), (531, 14)),
    (12, 2): ((535, 54, 3), (536, 25)),
    (12, 3): ((545, 23, 6), (545, 84)),
    (12, 4): ((550, 54, 14), (551, 61)),
    (12, 5): ((555, 42, 2), (555, 85)),
    (12, 6): ((560, 28, 3), (560, 76)),
    (12, 8): ((570, 26), (570, 65)),
    (12, 9): ((575, 51, 3), (576, 2)),
    (13, 0): ((580, 65, 6), (580,)),
    (13, 1): ((590, 44, 1), (590,)),
    (13, 2): ((595, 45, 4), (595,)),
    (13, 3): ((610, 43, 2), (610,)),
}

# Minor-version compatibility: a CUDA X.y binary runs on any driver at or above the X.x floor
# (Table 2). Below it, torch says "The NVIDIA driver on your system is too old".
MAJOR_FLOOR: dict[int, tuple[Version, Version]] = {
    11: ((450, 80, 2), (452, 39)),
    12: ((525, 60, 13), (527, 41)),
    13: ((580, 65, 6), (580,)),  # Windows: the R580 branch (see TOOLKIT_DRIVER)
}

# Driver branch -> the newest CUDA it supports (derived from Table 3; a branch not listed supports
# the toolkit of the branch below it, e.g. R565 -> 12.6).
BRANCH_MAX_CUDA: tuple[tuple[int, tuple[int, int]], ...] = (
    (450, (11, 0)), (455, (11, 1)), (460, (11, 2)), (465, (11, 3)), (470, (11, 4)), (495, (11, 5)),
    (510, (11, 6)), (515, (11, 7)), (520, (11, 8)), (525, (12, 0)), (530, (12, 1)), (535, (12, 2)),
    (545, (12, 3)), (550, (12, 4)), (555, (12, 5)), (560, (12, 6)), (570, (12, 8)), (575, (12, 9)),
    (580, (13, 0)), (590, (13, 1)), (595, (13, 2)), (610, (13, 3)),
)  # fmt: skip

# The first CUDA toolkit that supports an architecture; its driver is the oldest that runs the GPU.
# Keyed by compute capability; (major, None) covers every minor of that major.
FIRST_CUDA_FOR_ARCH: dict[tuple[int, int | None], tuple[int, int]] = {
    (8, 9): (11, 8),  # Ada
    (9, None): (11, 8),  # Hopper
    (10, None): (12, 8),  # Blackwell datacenter (B200, GB200; B300 is 10.3)
    (11, None): (13, 0),  # Thor
    (12, None): (12, 8),  # Blackwell consumer / workstation (RTX 50, RTX PRO; GB10 is 12.1)
}


def first_cuda_for(cc: tuple[int, int]) -> tuple[int, int] | None:
    """The oldest CUDA (hence driver) that supports compute capability ``cc``, where we know it."""
    return FIRST_CUDA_FOR_ARCH.get(cc) or FIRST_CUDA_FOR_ARCH.get((cc[0], None))

# PyTorch minor release -> CUDA wheel indexes on download.pytorch.org (RELEASE.md).
WHEEL_INDEXES: dict[tuple[int, int], tuple[str, ...]] = {
    (2, 5): ("cu118", "cu121", "cu124"),
    (2, 6): ("cu118", "cu124", "cu126"),
    (2, 7): ("cu118", "cu126", "cu128"),
    (2, 8): ("cu126", "cu128", "cu129"),
    (2, 9): ("cu126", "cu128", "cu130"),
    (2, 10): ("cu126", "cu128", "cu130"),
    (2, 11): ("cu126", "cu128", "cu130"),
    (2, 12): ("cu126", "cu130", "cu132"),
    (2, 13): ("cu126", "cu130", "cu132"),
    (2, 14): ("cu126", "cu130", "cu132"),
    (2, 15): ("cu130", "cu132"),  # planned in RFC pytorch/pytorch#190385: cu126 removed
}

_MAXWELL_TO_HOPPER = ((5, 0), (6, 0), (7, 0), (7, 5), (8, 0), (8, 6), (9, 0))
_TURING_TO_BLACKWELL = ((7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0))


def wheel_archs(torch_minor: tuple[int, int], index: str) -> tuple[tuple[int, int], ...]:
    """SASS architectures in the official Linux x86_64 wheel (TORCH_CUDA_ARCH_LIST, build_cuda.sh)."""
    if index == "cu118":
        return ((3, 7), *_MAXWELL_TO_HOPPER)
    if index in ("cu121", "cu124", "cu126"):
        return _MAXWELL_TO_HOPPER
    if index in ("cu128", "cu129"):
        # Volta was left out of 2.7 cu128, back for 2.8-2.10, dropped again from 2.11.
        with_volta = (2, 8) <= torch_minor <= (2, 10)
        return ((7, 0), *_TURING_TO_BLACKWELL) if with_volta else _TURING_TO_BLACKWELL
    return _TURING_TO_BLACKWELL  # cu13x: CUDA 13 cannot build for sm_50 - sm_72


def parse_version(text: str) -> Version:
    """Leading numeric parts of a version: "580.82.07" -> (580, 82, 7), "2.13.0+cu130" -> (2, 13, 0)."""
    parts = []
    for piece in re.split(r"[.+-]", text.strip()):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def base_version(text: str) -> str:
    """The release a version string names: "2.13.0+cu130" -> "2.13.0"."""
    return ".".join(str(p) for p in parse_version(text)[:3])


def sm_name(cc: tuple[int, int]) -> str:
    """(9, 0) -> "sm_90", as CUDA and torch.cuda.get_arch_list() spell it."""
    return f"sm_{cc[0]}{cc[1]}"


def driver_max_cuda(driver: Version) -> tuple[int, int] | None:
    """The newest CUDA a driver version supports, from its branch (R550 -> 12.4)."""
    best = None
    for branch, cuda in BRANCH_MAX_CUDA:
        if driver and driver[0] >= branch:
            best = cuda
    return best


@dataclass(frozen=True, kw_only=True)
class DriverNeed:
    """What a CUDA build needs of the driver: the floor to run at all and the toolkit's own driver."""

    floor: Version | None  # below this the wheel does not run; None where we have no table row
    toolkit_driver: Version | None  # at or above this, PTX JIT (and every API) works too


def driver_need(cuda: tuple[int, int], os_name: str) -> DriverNeed:
    """Driver versions a build for CUDA ``cuda`` needs on ``os_name`` ("Linux" or "Windows")."""
    column = 1 if os_name == "Windows" else 0
    floor = MAJOR_FLOOR.get(cuda[0])
    toolkit = TOOLKIT_DRIVER.get(cuda)
    return DriverNeed(
        floor=floor[column] if floor else None,
        toolkit_driver=toolkit[column] if toolkit else None,
    )


def index_cuda(index: str) -> tuple[int, int]:
    """ "cu130" -> (13, 0), "cu128" -> (12, 8)."""
    digits = index.removeprefix("cu")
    return int(digits[:-1]), int(digits[-1])


def format_version(version: Version) -> str:
    """NVIDIA's spelling: "580.65.06", "576.02" (parts after the branch have two digits)."""
    return ".".join(f"{p:02d}" if i else str(p) for i, p in enumerate(version))


@dataclass(frozen=True, kw_only=True)
class WheelChoice:
    """A PyTorch wheel index that fits this driver and GPU."""

    index: str  # e.g. "cu130"
    torch_version: str  # e.g. "2.13.0"

    @property
    def command(self) -> str:
        return (f"pip install torch=={self.torch_version} "
                f"--index-url https://download.pytorch.org/whl/{self.index}")


def choose_wheel(
    torch_version: str,
    *,
    driver: Version | None,
    capabilities: tuple[tuple[int, int], ...],
    os_name: str = "Linux",
) -> WheelChoice | None:
    """The newest CUDA wheel index of this PyTorch release that the driver runs and that has SASS
    for every GPU; ``None`` when no index fits (then the driver or the torch release must change)."""
    release = parse_version(torch_version)[:2]
    indexes = WHEEL_INDEXES.get(release)  # type: ignore[arg-type]
    if indexes is None:  # a release we have no table for: better no advice than wrong advice
        return None
    base = base_version(torch_version)
    fitting = [i for i in reversed(indexes)
               if all(has_sass(cc, wheel_archs(release, i)) for cc in capabilities)]
    # Prefer a build whose own toolkit driver is installed (full compatibility, PTX JIT works);
    # else the newest one that minor-version compatibility still runs.
    for full in (True, False):
        for index in fitting:
            need = driver_need(index_cuda(index), os_name)
            bound = need.toolkit_driver if full else need.floor
            if driver is None or bound is None or driver >= bound:
                return WheelChoice(index=index, torch_version=base)
    return None


def has_sass(cc: tuple[int, int], archs: tuple[tuple[int, int], ...]) -> bool:
    """SASS for sm_XY runs on compute capability X.Z with Z >= Y (same major)."""
    return any(a[0] == cc[0] and a[1] <= cc[1] for a in archs)


def arch_coverage(cc: tuple[int, int], arch_list: tuple[str, ...]) -> str | None:
    """How a wheel with ``arch_list`` (torch.cuda.get_arch_list()) runs on compute capability ``cc``:
    "sass" (native code), "ptx" (JIT-compiled by the driver at first use) or None (it does not).

    >>> arch_coverage((8, 9), ("sm_80", "sm_86")), arch_coverage((10, 3), ("sm_100a",))
    ('sass', None)
    """
    best = None
    for arch in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", arch)
        if not match:
            continue
        kind, target, suffix = match.group(1), (int(match.group(2)), int(match.group(3))), match.group(4)
        if kind == "sm":
            # sm_XYa runs on X.Y only; sm_XYf on the family X.Z with Z >= Y; plain sm_XY likewise.
            if (suffix == "a" and cc == target) or (suffix != "a" and has_sass(cc, (target,))):
                return "sass"
        elif suffix != "a" and target <= cc:
            best = "ptx"
    return best
