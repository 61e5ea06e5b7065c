"""``gpuwise watch -- CMD ...`` and ``gpuwise watch --pid N``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from gpuwise.cli._app import JsonFlag, app, check_plot
from gpuwise.errors import GpuwiseError


@app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
def watch(
    command: Annotated[list[str] | None, typer.Argument(
        help="The command to run and watch, after --: gpuwise watch -- python train.py --lr 3e-4",
        show_default=False)] = None,
    pid: Annotated[int | None, typer.Option("--pid", help="Attach to this running process instead (until it "
                                                          "ends, or Ctrl-C).")] = None,
    interval: Annotated[float, typer.Option("--interval", min=0.01, help="Seconds between samples.")] = 1.0,
    log: Annotated[str | None, typer.Option(help="Append every sample and step event to this JSON-lines file as "
                                                 "they come.")] = None,
    plot: Annotated[str | None, typer.Option(help="Draw the timeline (utilisation, memory, power; each step's time "
                                                  "and data wait; the command's RSS and allocator) to this PNG "
                                                  "file.")] = None,
    live: Annotated[bool, typer.Option("--live/--no-live", help="The status pinned under the command's output on "
                                                                "a terminal (--no-live for full-screen programs).")
                    ] = True,
    prometheus: Annotated[str | None, typer.Option(
        "--prometheus", metavar="HOST:PORT", help="Serve gpuwise_* metrics for Prometheus at http://HOST:PORT/metrics "
        "while the command runs (PORT alone: 127.0.0.1, this machine only; port 0: a free one).")] = None,
    json_out: JsonFlag = False,
) -> int:
    """Run a command (your own python train.py) and watch the GPUs and the host from outside: a live status, the
    bottleneck and its fix at the end. The command's exit code is passed through.

    Examples: gpuwise watch -- python train.py; gpuwise watch --log run.jsonl --plot run.png -- python train.py;
    gpuwise watch --pid 12345; gpuwise watch --prometheus 9400 -- python train.py
    """
    check_plot(plot)
    if plot is not None:  # checked before the command runs: its exit code must not be lost to a plot
        folder = Path(plot).resolve().parent
        if not folder.is_dir():
            raise GpuwiseError(f"cannot write --plot {plot}: folder {Path(plot).parent} does not exist",
                               f"create it: mkdir -p {Path(plot).parent}")
        if not os.access(folder, os.W_OK):
            raise GpuwiseError(f"cannot write --plot {plot}: folder {Path(plot).parent} is not writable",
                               "pick a folder you can write to")

    from gpuwise import render
    from gpuwise.monitor.watch import watch as run_watch
    from gpuwise.render.watch import WatchPanel

    # The live status only on a terminal: with stderr in a file or a pipe (CI, nohup, a scheduler's log) the
    # command's own stderr goes to the same place, and periodic status lines would be mixed into it; the samples
    # are in --log for that case. No live output with --json either.
    err = render.terminal(stderr=True)
    panel = WatchPanel(err) if live and not json_out and sys.stderr.isatty() else None

    def started(start) -> None:
        if start.note and not json_out:
            err.print(start.note, markup=False, soft_wrap=True)  # once, one line
        if start.metrics_url:  # on stderr, with --json too: port 0 is only known here
            err.print(f"metrics for Prometheus at {start.metrics_url}", markup=False, soft_wrap=True)
            if start.metrics_note:
                err.print(f"note: {start.metrics_note}", markup=False, soft_wrap=True)
        if panel is not None:
            panel.start(start)

    try:
        # With --json our stdout is the JSON: the command's own stdout goes to stderr, so the JSON parses.
        result = run_watch(command or None, pid=pid, interval_s=interval, log=log, on_start=started,
                           on_sample=None if panel is None else panel.update,
                           stdout=2 if json_out else None,  # fd 2: what our stderr is
                           prometheus=prometheus)
    finally:
        if panel is not None:
            panel.stop()
    render.emit(result, json=json_out)
    if result.log_error:
        print(f"warning: --log {log}: {result.log_error}; the run went on", file=sys.stderr)
    if plot is not None:  # after the summary: a plot that cannot be written loses nothing else
        from gpuwise.plot import plot_watch

        try:
            plot_watch(result, plot)
        except GpuwiseError as exc:  # the command's exit code still comes back
            print(f"warning: {exc}", file=sys.stderr)
        else:
            if not json_out:
                print(f"timeline drawn to {plot}")
    return result.exit_code or 0
