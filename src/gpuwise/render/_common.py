"""What every renderer shares: number formats, the JSON view of dataclasses, tables that fit the terminal, and the
progress line on stderr."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuwise.hardware.catalog import Accelerator

# The shape of every command's --json (and --format json) object, its first key. Raise it when a key is renamed,
# removed or changes meaning; adding a key keeps it. 1: the first versioned shape, where every command prints one
# object (a command that listed things, as gpus, doctor and bench did, holds its list under a named key).
SCHEMA_VERSION = 1

_STATUS_STYLE = {"ok": ("ok", "green"), "warn": ("warn", "yellow"), "fail": ("FAIL", "bold red")}


def _num(value: float | None, fmt: str = "g") -> str:
    return "-" if value is None else format(value, fmt)


def _short(value: float | None) -> str:
    """A rate or bandwidth for a narrow column: whole numbers from 100 up, else 3 digits."""
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def to_jsonable(obj: Any) -> Any:
    """Dataclasses (and lists of them) as plain JSON-ready values. JSON has no Infinity or NaN (json.dumps writes
    them, and strict readers refuse them): such a figure is null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Accelerator):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    return obj


def print_json(data: Any) -> None:
    print(json.dumps(to_jsonable(data), indent=2))


def json_document(data: Any) -> dict[str, Any]:
    """A command's JSON view as its output: the object, ``schema_version`` first. A list is no document: name it,
    ``{"findings": [...]}``, so a later key can sit beside it."""
    data = to_jsonable(data)
    if not isinstance(data, dict):
        raise TypeError(f"a command prints one JSON object, not a {type(data).__name__}")
    return {"schema_version": SCHEMA_VERSION, **{k: v for k, v in data.items() if k != "schema_version"}}


def _count(n: int) -> str:
    """Parameters as people say them: 124.4 M, 6.74 B."""
    return f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.4g} M" if n >= 1e6 else f"{n:,}"


def _seconds(s: float | None) -> str:
    if s is None or s != s:
        return "-"
    return f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _seconds3(s: float | None) -> str:
    """Three significant figures, for a narrow column: 95.1 µs, 604 ms, 1.23 s, 4210 s."""
    if s is None or s != s:
        return "-"
    s = float(f"{s:.3g}")  # rounded before the unit is chosen: 0.9996 s is 1 s, never "1e+03 ms"
    if s >= 100:
        return f"{s:.0f} s"
    return f"{s * 1e6:.3g} µs" if s < 1e-3 else f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def step_parts(phases: dict[str, float] | None, families: dict[str, float] | None) -> str:
    """A modelled step's time by phase and its largest op families, for one line under a table: "forward 12.1 ms,
    backward 24.0 ms, optimizer 1.2 ms, communication 3.0 ms; matmul 71%, elementwise 9%, ..." (zero phases left
    out; families over 3% of the kernels' time, "launch" the time waiting on the CPU)."""
    if not phases:
        return ""
    text = ", ".join(f"{name} {_seconds3(v)}" for name, v in phases.items() if v > 0)
    total = sum((families or {}).values())
    if total > 0:
        big = sorted(((v, f) for f, v in (families or {}).items() if v / total >= 0.03), reverse=True)
        text += "; " + ", ".join(f"{f} {100 * v / total:.0f}%" for v, f in big)
    return text


@dataclasses.dataclass(frozen=True, kw_only=True)
class Column:
    """One column of a result's rows: its stable key (the csv header, with its unit: ``memory_gib``), its header in
    a table, how a row reads in it, and how much it matters when the terminal is narrow.

    e.g. ``Column(key="bf16_tflops", header="bf16", priority=2, numeric=True)``
    """

    key: str
    header: str = ""  # in tables and Markdown; the key when empty
    priority: int = 0  # 0 is never hidden; the highest go first when the columns do not fit
    numeric: bool = False  # right-justified
    wrap: bool = False  # words (a shape, a note) that may go on two lines, split at spaces; never mid-word
    table: bool = True  # False: in csv and JSON only (its figure is shown in another column)
    show: Callable[[dict[str, Any]], str | Text] | None = None  # a row's text in tables and Markdown

    @property
    def title(self) -> str:
        return self.header or self.key

    def text(self, row: dict[str, Any]) -> str | Text:
        """This column's cell for ``row``: ``show(row)``, else the raw value ("-" for none, floats as %g)."""
        if self.show is not None:
            return self.show(row)
        value = row.get(self.key)
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return "-"
        return format(value, "g") if isinstance(value, float) else str(value)


def _widths(cells: Sequence[Text], header: str, wrap: bool) -> tuple[int, int]:
    """(natural, least) width of a column: its longest line, and what it needs at the least: the longest word
    where it may wrap at spaces, else the longest line too."""
    lines = [line for cell in cells for line in cell.plain.splitlines()] + header.splitlines()
    natural = max(Text(line).cell_len for line in lines)
    if not wrap:
        return natural, natural
    return natural, max(Text(word).cell_len for line in lines for word in line.split() or [""])


def _overhead(n: int, edge: bool = True) -> int:
    """Characters a SIMPLE_HEAD table with ``padding=(0, 1), pad_edge=False`` adds to its columns' widths: an edge
    each side (unless ``edge`` is False), a divider between columns, a space of padding each side of every inner
    divider."""
    return 2 * edge + (n - 1) + 2 * (n - 1)


def _text(cell: str | Text) -> Text:
    return cell if isinstance(cell, Text) else Text(str(cell))


def _cells(columns: Sequence[Column], rows: Sequence[Sequence[str | Text] | str | Text]) -> tuple[set[int], list]:
    """The rows as Texts, one per column; the indexes of the one-text rows that start a group."""
    groups = {i for i, row in enumerate(rows) if isinstance(row, (str, Text))}
    cells = [[_text(row)] + [Text("")] * (len(columns) - 1) if i in groups else [_text(c) for c in row]
             for i, row in enumerate(rows)]
    return groups, cells


def _layout(columns: Sequence[Column], cells: list[list[Text]], width: int, edge: bool) -> tuple[dict[int, int], bool]:
    """The columns a table ``width`` wide shows, each with its width, and whether they fit: the least-important
    column goes first (among equals the rightmost), then the ``wrap`` columns narrow, the widest first. False when
    even the priority-0 columns at their least are wider than ``width``."""
    sizes = [_widths([row[i] for row in cells], col.title, col.wrap) for i, col in enumerate(columns)]
    shown = list(range(len(columns)))
    while len(shown) > 1 and sum(sizes[i][1] for i in shown) + _overhead(len(shown), edge) > width:
        drop = max((i for i in shown if columns[i].priority > 0), key=lambda i: (columns[i].priority, i),
                   default=None)
        if drop is None:
            break
        shown.remove(drop)
    widths = {i: sizes[i][0] for i in shown}
    excess = sum(widths.values()) + _overhead(len(shown), edge) - width
    # the widest wrapping column gives a character at a time, so wrapped columns end up alike (a long job name
    # beside long answers wraps into a few lines each, not one of them into a word a line)
    while excess > 0:
        i = max((i for i in shown if columns[i].wrap and widths[i] > sizes[i][1]), key=lambda i: (widths[i], i),
                default=None)
        if i is None:
            break
        widths[i] -= 1
        excess -= 1
    return widths, excess <= 0


def fit_table(columns: Sequence[Column], rows: Sequence[Sequence[str | Text] | str | Text], width: int, *,
              title: str | None = None, edge: bool = True, lines: bool = False) -> tuple[Table, tuple[Column, ...]]:
    """A table of ``rows`` (one text per column) no wider than ``width``: when the columns do not fit, the ones with
    the highest ``priority`` are left out (priority 0 never), so no cell is cut ("3…") and no name is split
    ("a100-80gb" / "-sxm"); columns marked ``wrap`` narrow first, at spaces. A row that is one text, not a list,
    starts a group: a new section, the text alone in the first column ("datacenter"). Returns the table and the
    columns left out, for ``hidden_note``. ``lines``: a rule between rows (rows of several lines each). Where even
    the priority-0 columns are too wide, ``print_fit`` prints the rows as lines instead.

    e.g. ``table, hidden = fit_table([Column(key="key"), Column(key="gbps", priority=1)], [["h100-sxm", "3350"]], 60)``
    """
    groups, cells = _cells(columns, rows)
    widths, _ = _layout(columns, cells, width, edge)
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=edge, show_lines=lines)
    for i, w in widths.items():
        col = columns[i]
        # every width is set, so rich never narrows a column; "fold" (never "…") only if one name alone is wider
        # than the terminal
        table.add_column(col.title, justify="right" if col.numeric else "left", width=w, no_wrap=not col.wrap,
                         overflow="fold")
    for n, row in enumerate(cells):
        if n in groups and n > 0:
            table.add_section()
        table.add_row(*(row[i] for i in widths))
    return table, tuple(c for i, c in enumerate(columns) if i not in widths)


def hidden_note(hidden: Sequence[Column], width: int) -> str:
    """The line under a table that ``fit_table`` narrowed: which columns it left out, and how to see them."""
    if not hidden:
        return ""
    names = ", ".join(" ".join(c.title.split()) for c in hidden)  # a two-line header ("max\nbatch") on one line
    return (f"{len(hidden)} column{'s' * (len(hidden) > 1)} hidden at {width} columns ({names}): use --format csv "
            "or a wider terminal")


# A figure and its unit ("125.6 GiB", "8.24 ms", "900 GB/s") wraps as one word: a line never ends between them;
# nor does one start with a " · " separator (it stays at the end of the line before).
_UNITS = r"[KMGTP]i?B(?:/s)?|B|[mµun]s|s|min|h|d|W|[KMG]Hz|TFLOPS|TOPS|TF/s|FLOPs"
_WORD = re.compile(rf"(?:\S*\d (?:{_UNITS})(?![\w/])\S*|\S+)(?: ·(?= |$))?")


class Whole(str):
    """A text printed whole on one line, never wrapped: a command or flags to copy. Wider than the terminal, it
    overflows (the terminal folds it on screen; a copy still gets one line)."""


def wrap(text: str | Text, width: int, *, indent: int = 2) -> list[Text]:
    """``text`` in lines at most ``width`` cells wide, broken at spaces only, each line after the first indented by
    ``indent`` more than the paragraph's own leading spaces; "\n" starts a paragraph. A figure stays with its unit
    ("16.2 GiB"). A word wider than an indented line gets a line of its own at the paragraph's left edge, and only
    one wider than the whole line (a long URL) is cut, at the width, where a terminal would fold it. A ``Whole``
    text (a command) is one line, as given, however wide.

    e.g. ``wrap("time: to the goal at the predicted rate", 20)``: "time: to the goal at", "  the predicted rate"
    """
    if isinstance(text, Whole):
        return [Text(str(text))]
    text = _text(text)
    lines = []
    for para in text.split("\n", allow_blank=True):
        plain = para.plain
        words = [m.span() for m in _WORD.finditer(plain)]
        if not words:
            lines.append(Text(""))
            continue
        lead = words[0][0]
        spans = []  # (indent, start, end) of each line
        start, end, pad = words[0][0], words[0][1], lead
        for s, e in words[1:]:
            if pad + cell_len(plain[start:e]) > width:
                spans.append((pad, start, end))
                start, pad = s, lead + indent
                if pad + cell_len(plain[s:e]) > width:  # a word wider than an indented line: at the left edge
                    pad = lead
            end = e
        spans.append((pad, start, end))
        for pad, start, end in spans:
            room = max(width - pad, 1)
            while cell_len(plain[start:end]) > room:  # one word wider than the line: cut where a terminal folds
                cut = start + 1
                while cut < end and cell_len(plain[start:cut + 1]) <= room:
                    cut += 1
                lines.append(Text(" " * pad) + para[start:cut])
                start = cut
            lines.append(Text(" " * pad) + para[start:end])
    return lines


def wrap_units(units: Sequence[str | Text], width: int, *, indent: int = 2, sep: str = ", ") -> list[Text]:
    """Short texts ("memory: 80 GiB") joined by ``sep`` in lines at most ``width`` wide, every line indented by
    ``indent``, the separator (less its spaces) ending a line that goes on: a unit is split (at its spaces, by
    ``wrap``) only when it is wider than a line."""
    texts = [_text(u) for u in units]
    end = sep.rstrip()
    lines: list[Text] = []
    line: Text | None = None
    for n, unit in enumerate(texts):
        tail = len(end) if n < len(texts) - 1 else 0  # room for the separator, should the line end after this unit
        if line is not None and line.cell_len + len(sep) + unit.cell_len + tail <= width:
            line = line + sep + unit
            continue
        if line is not None:
            lines.append(line + end)
        line = Text(" " * indent) + unit
        if line.cell_len + tail > width:
            *head, line = wrap(line, width - tail, indent=0)
            lines += head
    return lines if line is None else [*lines, line]


def print_lines(console: Console, lines: Sequence[Text]) -> None:
    """Lines laid out already (``wrap``), printed as they are: rich neither wraps nor cuts them."""
    for line in lines:
        console.print(line, soft_wrap=True, highlight=False)


def print_wrapped(console: Console, text: str | Text, *, indent: int = 0) -> None:
    """A note in lines of the console's width, broken at spaces (``wrap``): a figure stays with its unit, a word is
    never split unless it is wider than the terminal, and the lines after the first go ``indent`` to the right."""
    print_lines(console, wrap(text, console.width, indent=indent))


FIELD_VALUE_MIN = 28  # narrower than this beside its key, a value goes on lines of its own under the key


def print_fields(console: Console, rows: Sequence[tuple[str | Text, str | Text]], *, title: str | Text | None = None,
                 gap: int = 2, key_style: str = "bold") -> None:
    """Key-value rows as a grid: keys in a column, each value wrapped at spaces beside its key. A value that needs
    more than one line where the value column is narrower than ``FIELD_VALUE_MIN``, or that holds a word wider than
    the column (a URL), goes under its key, indented by two, rather than split; a ``Whole`` value (a command) is
    one line, beside its key if it fits there. A row with no key goes on with the row above."""
    width = console.width
    if title is not None:
        print_lines(console, wrap(Text(title, style="italic") if isinstance(title, str) else title, width))
    keys = [Text(k, style=key_style) if isinstance(k, str) else k for k, _ in rows]
    column = max((k.cell_len for k in keys), default=0) + gap
    room = width - column
    beside = True
    for key, (_, value) in zip(keys, rows, strict=True):
        text = _text(value)
        widest = max((cell_len(w) for w in text.plain.split()), default=0)
        one_line = "\n" not in text.plain and cell_len(text.plain) <= room
        if key.plain:  # a row with no key goes on the one above it: in the value column, or under its key
            beside = one_line or (room >= FIELD_VALUE_MIN and not isinstance(value, Whole) and widest <= room)
        if beside:
            lines = wrap(value, room, indent=0)
            head = Text.assemble(key, " " * (column - key.cell_len))  # key + Text would give the line its style
            print_lines(console, [head + lines[0], *(Text(" " * column) + line for line in lines[1:])])
        else:
            print_lines(console, [key] * bool(key.plain) + [Text("  ") + line for line in wrap(value, width - 2,
                                                                                                 indent=0)])


def _stacked(columns: Sequence[Column], cells: list[list[Text]], groups: set[int], width: int) -> list[Text]:
    """Rows too wide for a table at ``width``, as lines: the row's name (its first column, after any marker column
    such as recommend's "*") on a line, its other columns under it as "header: value", every column shown."""
    lead = next((i for i, c in enumerate(columns) if any(ch.isalnum() for ch in c.title)), 0) + 1
    lines: list[Text] = []
    for n, row in enumerate(cells):
        if n in groups:
            lines += wrap(row[0], width)
            continue
        name = Text(" ").join(c for c in row[:lead] if c.plain.strip())
        lines += wrap(name, width)
        units = [Text(" ".join(col.title.split()) + ": ") + cell for col, cell in zip(columns[lead:], row[lead:],
                                                                                    strict=True)]
        lines += wrap_units(units, width)
    return lines


def title_over(console: Console, table: Table, title: str, *, edge: bool = True) -> None:
    """``title`` centred over ``table`` where it fits on a line, else printed now, wrapped (``wrap``: never a split
    unit)."""
    if cell_len(title) <= sum(c.width or 0 for c in table.columns) + _overhead(len(table.columns), edge):
        table.title = title
    else:
        print_wrapped(console, Text(title, style="italic"))


def print_fit(console: Console, columns: Sequence[Column], rows: Sequence[Sequence[str | Text] | str | Text], *,
              title: str | None = None, edge: bool = True, lines: bool = False,
              notes: Sequence[str | Text] = ()) -> None:
    """``rows`` as a table that fits the console (``fit_table``: the least-needed columns left out, a line saying
    which, after the ``notes``), or, where even its priority-0 columns cannot fit, as lines: each row's name, then
    "header: value" for all its columns. No name is split and no figure cut at any width."""
    width = console.width
    groups, cells = _cells(columns, rows)
    _, fits = _layout(columns, cells, width, edge)
    hidden: tuple[Column, ...] = ()
    if fits:
        table, hidden = fit_table(columns, rows, width, edge=edge, lines=lines)
        if title:
            title_over(console, table, title, edge=edge)
        console.print(table)
    else:
        if title:
            print_wrapped(console, Text(title, style="italic"))
        print_lines(console, _stacked(columns, cells, groups, width))
    for note in notes:
        print_wrapped(console, note)
    if hidden:
        print_wrapped(console, hidden_note(hidden, width))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sheet:
    """A result as rows: one dict a row under the columns' keys, raw numbers with their unit in the key
    (``memory_gib``, ``median_s``), and the lines a table or Markdown prints under it.

    e.g. ``Sheet(title="catalog", columns=(Column(key="key"),), rows=({"key": "h100-sxm"},))``
    """

    title: str
    columns: tuple[Column, ...]
    rows: tuple[dict[str, Any], ...]
    notes: tuple[str, ...] = ()

    @property
    def shown(self) -> tuple[Column, ...]:
        """The columns a table or Markdown shows (the others are csv's only)."""
        return tuple(c for c in self.columns if c.table)


def print_table(sheet: Sheet, console: Console) -> None:
    """The sheet as a table as wide as the console at most (``print_fit``), its notes under it; columns left out
    say so on the last line."""
    columns = sheet.shown
    print_fit(console, columns, [[c.text(row) for c in columns] for row in sheet.rows], title=sheet.title,
              notes=sheet.notes)


def show_progress(output_format: str, stream: Any = None) -> bool:
    """Whether a long step should show a progress line: only for tables, and only when stderr is a terminal (a
    program reading JSON or csv, or a log file, gets none)."""
    stream = sys.stderr if stream is None else stream
    return output_format == "table" and hasattr(stream, "isatty") and stream.isatty()


@contextlib.contextmanager
def progress(text: str, *, enabled: bool) -> Iterator[Callable[[str], None]]:
    """A spinner and ``text`` on stderr while the block runs, gone after it; yields a function that changes the
    text. Does nothing when not ``enabled`` (see ``show_progress``).

    e.g. ``with progress("capturing gpt2", enabled=show_progress(fmt)) as say: ...; say("costing 77 GPUs")``
    """
    if not enabled:
        yield lambda _text: None
        return
    with Console(stderr=True).status(text) as status:
        yield lambda new: status.update(new)
