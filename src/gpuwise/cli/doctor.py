"""``gpuwise doctor``."""

from __future__ import annotations

import os

import typer

from gpuwise.cli._app import JsonFlag, app


@app.command()
def doctor(json_out: JsonFlag = False) -> None:
    """Check the PyTorch / CUDA / driver / GPU stack and say how to fix what is wrong.

    Exit code 0 when no check fails, 1 when one does.

    Examples: gpuwise doctor; gpuwise doctor --json
    """
    from gpuwise import render
    from gpuwise.doctor import diagnose
    from gpuwise.environment import gather_environment

    report = diagnose(gather_environment(os.environ))
    render.emit(report, json=json_out)
    raise typer.Exit(report.exit_code)
