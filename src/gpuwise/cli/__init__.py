"""The ``gpuwise`` command line: one file per command, each of which parses, calls one library function and
hands the result to ``render.emit``.

Errors a user can fix print one line, ``error: <what> (hint: <what to do>)``, and exit 2; a traceback only
with ``GPUWISE_DEBUG=1``. Anything else is our bug: exit 3.
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import gc
import inspect
import os
import re
import signal
import sys
import threading
import traceback
import unicodedata

import typer

from gpuwise.cli import bench, doctor, gpus, plan, recommend, train, watch  # noqa: F401  (each registers its command)
from gpuwise.cli._app import app
from gpuwise.errors import GpuwiseError, first_line
from gpuwise.files import DISK_FULL


def _usage_error_types() -> tuple[type[BaseException], ...]:
    """Click's usage-error base class, wherever this typer keeps click (vendored or not)."""
    return tuple(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _first_word(argv: list[str]) -> str | None:
    """The command argv names, if any: its first word that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def _command_name(argv: list[str]) -> str:
    """ "gpuwise gpus" when argv names a command, else "gpuwise"."""
    word = _first_word(argv)
    known = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    return f"gpuwise {word}" if word in known else "gpuwise"


def _keep_examples(group) -> None:
    """Click rewraps every help paragraph; the examples go one to a line in a paragraph led by a \\b line (which click
    keeps as written), and the command list shows each first sentence whole (click cuts it at 45 characters)."""
    for command in group.commands.values():
        if not command.help:
            continue
        text = inspect.cleandoc(command.help)
        command.short_help = re.split(r"\.\s", text, maxsplit=1)[0].rstrip(".")
        head, sep, examples = text.partition("Examples:")
        if sep:
            lines = [e.strip() for e in " ".join(examples.split()).split(";") if e.strip()]
            command.help = head + "\b\nExamples:\n" + "\n".join(f"  {e}" for e in lines)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: Python's exit flushes it, and a flush into the closed pipe prints a warning."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _one_line(text: str) -> str:
    """An error is one line: a newline (or another control character) in a value the user typed is shown escaped,
    as Python writes it ("a\\nb"), not printed."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# What the output's own characters become on a stream that cannot encode them (PYTHONIOENCODING=ascii, LC_ALL=C
# without Python's UTF-8 mode, a latin-1 terminal): one ASCII character where one says it, so tables keep their
# columns; anything else as its compatibility decomposition's ASCII letters (superscript 2 -> 2), else "?"
_ASCII = {"·": "-", "×": "x", "—": "-", "–": "-", "−": "-", "⁻": "-", "µ": "u", "μ": "u", "…": "...", "→": "->",
          "←": "<-", "≈": "~", "±": "+/-", "≤": "<=", "≥": ">=", "÷": "/", "°": " deg", "§": "sec. ", "█": "#",
          "─": "-", "━": "-", "│": "|", "┃": "|", "‘": "'", "’": "'", "“": '"', "”": '"', "✓": "ok", "✗": "x",
          "\u00a0": " "}
_FALLBACK = "gpuwise-ascii"


def _fallback(exc: UnicodeError) -> tuple[str, int]:
    """The codec error handler ``_FALLBACK``: the characters the stream's encoding cannot take, as ``_ASCII`` says."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    out = []
    for c in exc.object[exc.start:exc.end]:
        plain = unicodedata.normalize("NFKD", c).encode("ascii", "ignore").decode()
        out.append(_ASCII.get(c) or plain or "?")
    return "".join(out), exc.end


codecs.register_error(_FALLBACK, _fallback)


def _encodable_output() -> None:
    """stdout and stderr that encode every character we print: where the stream's encoding cannot (ascii, latin-1),
    its errors go to ``_FALLBACK`` instead of a UnicodeEncodeError (exit 3) halfway through a table."""
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or "utf-8"
        try:
            "·×—µ…→─".encode(encoding)
        except UnicodeEncodeError:
            with contextlib.suppress(AttributeError, ValueError, OSError):
                stream.reconfigure(errors=_FALLBACK)  # type: ignore[union-attr]
        except LookupError:  # an encoding Python does not know: it could not have printed anything either
            pass


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code: 0 ok, 1 a check failed, 2 a usage error, 3 a bug (the traceback too
    with GPUWISE_DEBUG=1), 130 interrupted, 141 (128 + SIGPIPE, as the shell reports cat's) when the reader of a pipe
    left early."""
    _encodable_output()
    argv = list(sys.argv[1:] if argv is None else argv) or ["--help"]
    debug = os.environ.get("GPUWISE_DEBUG", "") not in ("", "0")
    command = typer.main.get_command(app)
    _keep_examples(command)
    try:
        result = command.main(args=argv, prog_name="gpuwise", standalone_mode=False)
    except GpuwiseError as exc:
        if debug:
            traceback.print_exc()
        print(f"error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except _usage_error_types() as exc:
        if debug:
            traceback.print_exc()
        message = _one_line(exc.format_message().replace("\n", " "))  # type: ignore[attr-defined]
        print(f"error: {message} (hint: run '{_command_name(argv)} --help')", file=sys.stderr)
        return 2
    except (typer.Abort, KeyboardInterrupt):
        print("error: interrupted", file=sys.stderr)
        return 130
    except typer.Exit as exc:
        return exc.exit_code
    except BrokenPipeError:  # the reader left (gpuwise gpus | head -1): stop quietly, as cat and git do
        _quiet_stdout()
        return 128 + signal.SIGPIPE
    except SystemExit as exc:  # click catches the broken pipe itself: it wraps stdout to pacify it, then exits 1
        if type(sys.stdout).__name__ != "PacifyFlushWrapper":
            raise
        _quiet_stdout()
        return 128 + signal.SIGPIPE if exc.code == 1 else exc.code
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            return _internal(exc, debug)
        if debug:
            traceback.print_exc()
        _quiet_stdout()  # what is still buffered for the full device would fail again at exit
        where = f" writing {exc.filename}" if exc.filename else " writing the output"
        print(f"error: {exc.strerror or 'disk full'}{where} (hint: free space there (df -h), or send the output "
              "elsewhere)", file=sys.stderr)
        return 2
    except Exception as exc:
        return _internal(exc, debug)
    return result if isinstance(result, int) else 0


# Commands that only compute and print. Once their output is flushed and the atexit handlers have run, their process
# ends without Python's teardown: freeing torch's modules and the captures object by object, and a last collection,
# took 0.65 s of CPU (and of wall time) of a cold `gpuwise plan --model gpt2`, a fifth of the command, with nothing to
# show for it. Instagram's servers skip the same teardown the same way (``os._exit`` after the atexit handlers).
# Commands that run the user's code or write files as they go (train, watch, bench) end as Python ends.
QUICK_EXIT = frozenset({"plan", "recommend", "gpus"})
# Of those, the commands that capture a model. The planner's imports (torch and what it holds: over a million objects)
# live as long as the process, yet each full collection of the cyclic garbage collector walks them all again: 0.4 s of
# CPU of a cold `gpuwise plan --model gpt2`. Imported first and frozen (``gc.freeze``: out of every later collection's
# walk), they cost half that; what the command itself makes is collected as before, if less often (the youngest
# generation at 10,000 allocations, Python's default is 700: a capture makes and drops hundreds of thousands of small
# objects; peak memory of recommend llama2-7b stayed at 612 MiB). Only where the process then ends quickly: at a
# normal exit triton's bindings report the frozen objects as leaks, so they are unfrozen first.
CAPTURING = frozenset({"plan", "recommend"})
GEN0_THRESHOLD = 10_000


def run() -> None:
    """The ``gpuwise`` console script and ``python -m gpuwise``: ``main``, then the process ends with its code (for
    QUICK_EXIT's commands without Python's teardown; ``GPUWISE_QUICK_EXIT=0`` keeps it)."""
    command = _first_word(sys.argv[1:])
    quick = command in QUICK_EXIT and os.environ.get("GPUWISE_QUICK_EXIT", "1") != "0"
    frozen = quick and command in CAPTURING
    if frozen:
        with contextlib.suppress(Exception):  # main imports it again, and reports what fails
            import gpuwise.planning.planner  # noqa: F401  (the imports CAPTURING's comment freezes)
        gc.freeze()
        gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])
    code = main()
    if quick:
        _quick_exit(code)  # returns only where the normal exit must run
    if frozen:
        gc.unfreeze()
    sys.exit(code)


def _quick_exit(code: int) -> None:
    """End now with ``code``: the output flushed and every atexit handler run (logging's, multiprocessing's,
    ``weakref.finalize``'s, torch's), as a normal exit runs them; only the teardown after them is skipped. Returns
    (for a normal exit) where a thread the normal exit would wait for is still running, or the output cannot be
    flushed (the normal exit reports that as it always has)."""
    if any(t.is_alive() and not t.daemon and t is not threading.main_thread() for t in threading.enumerate()):
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    atexit._run_exitfuncs()
    with contextlib.suppress(OSError, ValueError):  # what a handler printed
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _internal(exc: BaseException, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    print(f"error: internal error: {_one_line(first_line(exc))} "
          "(hint: rerun with GPUWISE_DEBUG=1 and report the traceback)", file=sys.stderr)
    return 3


__all__ = ["QUICK_EXIT", "app", "main", "run"]
