"""``gpuwise doctor``: the findings table."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

from gpuwise.doctor import DoctorReport
from gpuwise.render._common import (
    _STATUS_STYLE,
    FIELD_VALUE_MIN,
    Whole,
    print_lines,
    print_wrapped,
    to_jsonable,
    wrap,
)

if TYPE_CHECKING:  # these import torch; gpus and doctor render without it
    pass

# A command in a fix's prose: where it starts, its shell words (a quoted one whole), pip's options that take a value,
# and a requirement after the first ("triton==3.6.0", "torch[opt]>=2.9")
_COMMAND = re.compile(r"(?<![^\s(])(?:pip3? install|python3? -[cm])(?= )")
_SHELL_WORD = re.compile(r"""(?:'[^']*'|"[^"]*"|[^\s'"])+""")
_PIP_VALUED = frozenset({"--index-url", "--extra-index-url", "-i", "-f", "--find-links", "-c", "--constraint", "-r",
                         "--requirement", "-t", "--target"})
_REQUIREMENT = re.compile(r"[A-Za-z0-9][\w.\-]*(?:\[[\w,\-]+\])?(?:[=<>!~]=?[\w.*+!]+)?$")


def _command_end(text: str, start: re.Match[str]) -> int:
    """Where the command that ``start`` found ends: after its options (with their values) and its first argument (the
    package, the code, the module), and any more requirements for pip; at the first word of prose ("(with your
    --index-url)", "to see the error"), or at punctuation after a word (", or ...")."""
    pip = start.group().startswith("pip")
    end, first, valued = start.end(), True, False
    for match in _SHELL_WORD.finditer(text, start.end()):
        word = match.group()
        core = word if word[-1] in "'\"" else word.rstrip(",;:.")
        if valued:  # the value of the option before it
            valued = False
        elif core.startswith("-"):
            valued = pip and core in _PIP_VALUED
        elif first and (not pip or _REQUIREMENT.match(core)):  # the package, the code, the module
            first = False
        elif not (pip and _REQUIREMENT.match(core) and any(c in core for c in "=<>[")):  # not one more requirement
            break
        end = match.start() + len(core)
        if core != word:
            break
    return end


def fix_parts(fix: str) -> list[str]:
    """A fix as its prose and the shell commands in it (``pip install ...``, ``python -c '...'``), in order, each
    command a ``Whole``: printed on a line of its own, it pastes as printed. An opening parenthesis just before a
    command goes on with the prose after it, so that no line is a lone "(".

    e.g. ``fix_parts("reinstall: pip install torch==2.13.0 (with your --index-url)")``: "reinstall:",
    ``Whole("pip install torch==2.13.0")``, "(with your --index-url)"
    """
    parts: list[str] = []
    pos, carry = 0, ""
    for match in _COMMAND.finditer(fix):
        if match.start() < pos:
            continue
        prose = carry + fix[pos:match.start()].strip()
        carry = ""
        if prose.endswith("("):
            prose, carry = prose[:-1].rstrip(), "("
        if prose:
            parts.append(prose)
        pos = _command_end(fix, match)
        parts.append(Whole(fix[match.start():pos]))
    rest = (carry + fix[pos:].strip()).strip()
    return parts + [rest] * bool(rest)


def doctor_json(report: DoctorReport) -> dict[str, Any]:
    """``doctor --json``: every check's finding, in order, under "findings"."""
    return {"findings": [to_jsonable(f) for f in report.findings]}


def _finding(message: str, fix: str | None) -> list[Text | Whole]:
    """A finding's paragraphs: its message, then "fix: " and the fix's prose, each command in it on its own."""
    parts: list[Text | Whole] = [Text(message)]
    if fix:
        pieces = fix_parts(fix)
        if isinstance(pieces[0], Whole):
            pieces.insert(0, "")
        parts.append(Text(f"fix: {pieces[0]}".rstrip(), style="cyan"))
        parts += [p if isinstance(p, Whole) else Text(p, style="cyan") for p in pieces[1:]]
    return parts


def _lines(parts: list[Text | Whole], width: int) -> list[Text]:
    """The paragraphs in lines ``width`` wide, wrapped at spaces; a command whole, two to the right."""
    return [line for p in parts
            for line in ([Text(f"  {p}", style="cyan")] if isinstance(p, Whole) else wrap(p, width, indent=0))]


def render_doctor(report: DoctorReport, console: Console) -> None:
    """One line a check: its status, its name, what it found and the fix, wrapped at spaces beside them (under them
    where the terminal is narrow), so a version, a path or a URL is never split, and each command in a fix on a
    line of its own, whole, to copy. The layout is ``print_fields``' (a finding beside its check where the column
    is ``FIELD_VALUE_MIN`` wide and holds its longest word and its commands, else under it), but for the commands."""
    width = console.width
    rows = []
    for f in report.findings:
        label, style = _STATUS_STYLE[f.status]
        # assembled, not added: ``a + b`` gives the whole line a's style (the finding would be green or red)
        rows.append((Text.assemble((f"{label:<4}", style), (f"  {f.check}", "bold")), _finding(f.message, f.fix)))
    print_lines(console, wrap(Text("gpuwise doctor", style="bold"), width))
    column = max((key.cell_len for key, _ in rows), default=0) + 2
    room = width - column
    for key, parts in rows:
        prose = [p for p in parts if not isinstance(p, Whole)]
        widest = max((cell_len(w) for p in prose for w in p.plain.split()), default=0)
        longest = max((cell_len(p) + 2 for p in parts if isinstance(p, Whole)), default=0)
        one_line = len(parts) == 1 and parts[0].cell_len <= room
        if one_line or (room >= FIELD_VALUE_MIN and max(widest, longest) <= room):
            lines = _lines(parts, room)
            head = Text.assemble(key, " " * (column - key.cell_len))
            print_lines(console, [head + lines[0], *(Text(" " * column) + line for line in lines[1:])])
        else:
            print_lines(console, [key, *(Text("  ") + line for line in _lines(parts, width - 2))])
    fails = sum(f.status == "fail" for f in report.findings)
    warns = sum(f.status == "warn" for f in report.findings)
    verdict = "stack OK" if not fails else "stack has problems: apply the fixes above"
    print_wrapped(console, f"{fails} failed, {warns} warnings, {len(report.findings) - fails - warns} ok: {verdict}")
