"""The ``engine`` command: ``fit`` / ``validate`` / ``test`` / ``predict`` from config files,
``demo``, ``inspect CKPT`` and ``replay RUN_DIR`` (see docs/cli.md).

The package, one module per command, :func:`main` here dispatching to them:

- ``_stages``: ``fit`` / ``validate`` / ``test`` / ``predict``, a run described by config files
  (jsonargparse, as LightningCLI parses its own), and :func:`build`, which builds the same
  pieces for a script to call (LightningCLI's ``run=False``).
- ``_checks``: what the command checks so that a bad value is answered with one ``error:`` line
  (the config's YAML bounds, values jsonargparse lets through, which exceptions are refusals).
- ``_inspect``: ``inspect CKPT``.
- ``_replay``: ``replay RUN_DIR``.
- ``demo`` runs examples/digits.py of a source checkout (:func:`_demo`, here).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from engine.cli._checks import _fail
from engine.cli._inspect import _inspect
from engine.cli._replay import _replay
from engine.cli._stages import STAGES, Built, build

__all__ = ["Built", "build", "main"]


def _demo(argv: list[str]) -> int:
    """Run examples/digits.py (a source checkout's) with ``argv``."""
    import runpy

    import engine

    script = Path(engine.__file__).resolve().parent.parent / "examples" / "digits.py"
    if not script.is_file():
        return _fail(
            f"engine demo runs examples/digits.py of a source checkout, not found at {script}; "
            "clone the repository and install it with pip install -e '.[demo]'"
        )
    try:
        import sklearn  # noqa: F401
    except ImportError:
        return _fail("engine demo needs scikit-learn (its digits data): pip install 'engine[demo]'")
    namespace = runpy.run_path(str(script), run_name="engine_demo")
    program, sys.argv[0] = sys.argv[0], "engine demo"  # the script's --help names the command
    try:
        namespace["main"](argv)
    finally:
        sys.argv[0] = program
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``engine`` command; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # the user's modules in the current directory import, as under `python -m engine` (or
    # `python script.py` from there): the `engine` script's own directory is .venv/bin
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    if argv and argv[0] in STAGES:  # their own parser: config files and --KEY=VALUE overrides
        from engine.cli._stages import run

        return run(argv[0], argv[1:])
    if argv and argv[0] == "demo":  # the script parses its own flags
        return _demo(argv[1:])
    parser = argparse.ArgumentParser(prog="engine", description="engine's command line")
    sub = parser.add_subparsers(dest="command", required=True)
    for stage, text in STAGES.items():  # listed here; parsed by engine.cli._stages
        sub.add_parser(stage, help=f"{text} (engine {stage} --help)", add_help=False)
    sub.add_parser(
        "demo",
        help="train on scikit-learn's digits (examples/digits.py; engine demo --epochs 3)",
        add_help=False,
    )
    p = sub.add_parser(
        "inspect",
        help="show a checkpoint's counters, metrics and integrity, or what a run directory holds",
    )
    p.add_argument("path", help="a checkpoint directory, or a run directory (its journal.jsonl)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_inspect)
    p = sub.add_parser(
        "replay",
        help="re-execute steps of a journaled run and check them bitwise against its journal",
        description=(
            "Load the newest checkpoint taken before step FROM, re-execute the steps up to TO "
            "and compare each step's loss, and the learning rates and state fingerprints, with "
            "the journal; a divergence is named by its step (or, for a journal without "
            "per-step losses, the interval of steps it lies in). Exit status 0: bitwise "
            "identical; 1: a divergence or an anomaly; 2: an error."
        ),
    )
    p.add_argument("run_dir", help="a run directory (it holds journal.jsonl)")
    p.add_argument("--from", dest="from_step", type=int, help="first step to re-execute")
    p.add_argument("--to", dest="to_step", type=int, help="last step to re-execute")
    p.add_argument(
        "--detect-anomaly",
        action="store_true",
        help="run steps FROM..TO under torch.autograd anomaly detection",
    )
    p.add_argument(
        "--trust-code",
        action="store_true",
        help="allow unpickling the run's task, model and data (this runs code from RUN_DIR)",
    )
    p.add_argument(
        "--data", metavar="MODULE:ATTR", help="the training data, when the run has no data.pkl"
    )
    p.set_defaults(run=_replay)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
