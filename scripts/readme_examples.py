"""Regenerate the README's example output: every ``$ gpuwise ...`` line in a fenced block whose output does not
depend on the machine (the catalog, plans and recommendations on fake tensors) is run at 100 columns and the
lines under it replaced by what it prints. ``tests/test_readme.py`` fails when they drift; this writes them.

    python scripts/readme_examples.py           # rewrite README.md in place (atomically), list what changed
    python scripts/readme_examples.py --check   # change nothing; exit 1 if any example drifted

Blocks that elide output with a "..." line are left alone and listed: check those by hand. Commands that show
this machine (doctor, bench, train, watch, --local) are real runs pasted by hand.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MACHINE_DEPENDENT = ("doctor", "bench", "train", "watch", "--local")  # as tests/test_readme.py
WIDTH = "100"


def _clean(lines: list[str]) -> list[str]:
    text = "\n".join(line.rstrip() for line in lines).strip("\n")
    return text.splitlines() if text else []


def run(command: str) -> list[str]:
    env = {**os.environ, "COLUMNS": WIDTH, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "gpuwise", *shlex.split(command)[1:]], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    return _clean((done.stdout + done.stderr).splitlines())


def regenerate(text: str) -> tuple[str, list[str], list[str]]:
    """The README with every checked example's output as printed now; the commands changed and those elided."""
    changed, elided = [], []

    def block(match: re.Match) -> str:
        lines = match.group(1).splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
        out = lines[:starts[0]] if starts else lines
        for k, i in enumerate(starts):
            j = starts[k + 1] if k + 1 < len(starts) else len(lines)
            command, shown = lines[i][2:].split("  #")[0].strip(), lines[i + 1:j]
            out.append(lines[i])
            if not command.startswith("gpuwise ") or any(w in command.split() for w in MACHINE_DEPENDENT):
                out += shown
            elif any(line.strip() == "..." for line in shown):
                elided.append(command)
                out += shown
            else:
                printed = run(command)
                if printed != _clean(shown):
                    changed.append(command)
                out += printed + ([""] if k + 1 < len(starts) else [])  # a blank line between commands
        return "```\n" + "\n".join(out) + "\n```"

    return re.sub(r"^```\n(.*?)^```", block, text, flags=re.S | re.M), changed, elided


def main() -> int:
    check = "--check" in sys.argv[1:]
    text = README.read_text()
    new, changed, elided = regenerate(text)
    for command in elided:
        print(f"elided, check by hand: {command}")
    for command in changed:
        print(f"{'drifted' if check else 'regenerated'}: {command}")
    if check:
        return 1 if changed else 0
    if new != text:
        tmp = README.with_suffix(".md.tmp")
        tmp.write_text(new)
        os.replace(tmp, README)
    return 0


if __name__ == "__main__":
    sys.exit(main())
