"""README output is real output: every ``$ gpuwise ...`` example whose output does not depend on the machine
(the catalog and plans on fake tensors) is run again and must print what the README shows.

When one drifts, ``python scripts/readme_examples.py`` regenerates them all (``--check`` only lists them).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import run_cli

README = Path(__file__).resolve().parents[1] / "README.md"
MACHINE_DEPENDENT = ("doctor", "bench", "train", "watch", "--local")  # these show this machine: read, not compared
WIDTH = "100"


def examples() -> list[tuple[str, str]]:
    """(command, the output the README shows under it) for every ``$ gpuwise`` line in a fenced block."""
    found = []
    for block in re.findall(r"^```\n(.*?)^```", README.read_text(), flags=re.S | re.M):
        lines = block.splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
        for i, j in zip(starts, [*starts[1:], len(lines)][:len(starts)], strict=True):
            command = lines[i][2:].split("  #")[0].strip()
            if command.startswith("gpuwise ") and not any(w in command.split() for w in MACHINE_DEPENDENT):
                found.append((command, "\n".join(lines[i + 1:j])))
    return found


def _clean(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n")


def test_the_readme_has_examples_to_check():
    commands = [c for c, _ in examples()]
    assert any(c.startswith("gpuwise plan") for c in commands) and any(c.startswith("gpuwise gpus") for c in commands)


@pytest.mark.parametrize(("command", "shown"), examples(), ids=[c for c, _ in examples()])
def test_readme_example_is_what_the_command_prints(capsys, monkeypatch, seeded_subprocesses, command, shown):
    """The bare ``gpuwise recommend`` ranks its jobs in worker processes: they share the session's captures
    (``seeded_subprocesses``) with test_search.py's guide test, so the two capture the jobs' models once."""
    monkeypatch.setenv("COLUMNS", WIDTH)
    _, out, err = run_cli(capsys, *shlex.split(command)[1:])
    printed = _clean(out + err)
    # A line "..." in the README elides part of the output: each shown part must appear, in order.
    parts = [_clean(p) for p in re.split(r"^\s*\.\.\.$", shown, flags=re.M)]
    if len(parts) == 1:
        assert printed == parts[0]
        return
    at = 0
    for part in parts:
        found = printed.find(part, at)
        assert found >= 0, f"not printed (after character {at}):\n{part}"
        at = found + len(part)
