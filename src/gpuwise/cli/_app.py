"""The typer app every command file registers with, and the options they share."""

from __future__ import annotations

from typing import Annotated

import typer

from gpuwise import __version__

app = typer.Typer(
    name="gpuwise",
    help="Measured answers to GPU questions: is my stack right, will it fit, which GPU, how fast.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
DeviceOption = Annotated[str | None, typer.Option(
    help="cpu, cuda, cuda:N or mps (default: the first GPU torch can use, else mps, else cpu).")]


def _version(value: bool) -> None:
    if value:
        print(f"gpuwise {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """gpuwise: GPU answers with measurements instead of folklore."""


def check_png(plot: str | None) -> None:
    """``--plot`` draws PNGs: any other suffix is refused before the work starts."""
    from gpuwise.errors import GpuwiseError

    if plot is not None and not plot.lower().endswith(".png"):
        raise GpuwiseError(f"--plot {plot}: the picture is a PNG", f"pass --plot {plot.rsplit('.', 1)[0]}.png")
