"""The mhctool command line: the Typer app, which registers each command from its own module
(options and printing only; the engines they call are imported inside each command, so that
``mhctool --help`` and a usage error answer without importing torch).

Exit codes: 0 all checks passed, 1 a numerics or verdict failure, 2 bad usage or input.
"""
from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup

from mhctool import __version__
from mhctool.cli import bench as cli_bench
from mhctool.cli import doctor as cli_doctor
from mhctool.cli import gate as cli_gate
from mhctool.cli import identify as cli_identify
from mhctool.cli import parity as cli_parity
from mhctool.cli import train as cli_train
from mhctool.cli.goldens import goldens_app
from mhctool.cli.console import err, guard, out, state
from mhctool.cli.report import report_app
from mhctool.cli.stability import stability_app
from mhctool.core.errors import SIGNALLED, Interrupted, UsageError

class _OneSentence(TyperGroup):
    """The command line's group: a value its option refuses (a number out of its range, a choice it
    does not take) is one sentence naming the option, exit 2, as every other bad input is; other
    usage errors (an unknown option) print click's usage and words, as before."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.BadParameter as e:
            err.print(f"error: {_refused(e)}", markup=False, highlight=False)
            sys.exit(2)
        except _CLICK_ERROR:  # raised while parsing, before anything ran: click's own words, as before
            return super().main(args, prog_name, complete_var, standalone_mode=True, **extra)
        except typer.Abort:
            err.print("Aborted!", markup=False)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


# click's usage errors' base (typer carries its own click from 0.17 on, and re-exports its errors)
_CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _refused(e) -> str:
    """``--seeds: input should be greater than or equal to 1`` from the refusal of a value."""
    p = getattr(e, "param", None)
    name = max(p.opts, key=len) if p is not None and getattr(p, "opts", None) else (e.param_hint or "a value")
    text = str(e.message).rstrip(".")
    return f"{name}: {text[:1].lower()}{text[1:]}"


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, cls=_OneSentence,
                  help="Numerics validation for fused mHC and grouped-MLP kernels.")


app.add_typer(report_app, name="report")


app.add_typer(stability_app, name="stability")


app.add_typer(goldens_app, name="goldens")


app.command()(guard(cli_identify.identify))


app.command()(guard(cli_train.train))
# registered in this order, which --help lists
app.command()(cli_parity.parity)
app.command()(cli_bench.bench)
app.command()(cli_gate.gate)
app.command()(cli_doctor.doctor)


def main() -> None:
    try:
        app()
    except UsageError as e:
        err.print(f"error: {e}")
        sys.exit(2)
    except Interrupted:
        if not SIGNALLED:  # else the signal came while loading, and the loader said so already
            err.print("interrupted: stopped at once; no report written")
        sys.exit(130)


def _version(value: bool) -> None:
    if value:
        out.print(f"mhctool {__version__}", markup=False)
        raise typer.Exit(0)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
          version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print mhctool's version and exit.")):
    state["debug"] = debug


if __name__ == "__main__":  # pragma: no cover
    main()
