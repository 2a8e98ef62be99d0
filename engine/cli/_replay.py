"""``engine replay RUN_DIR``: :func:`engine.replay` from the command line, each way it can fail
answered with one ``error:`` line (exit status 2), a divergence or an anomaly with exit status
1."""

from __future__ import annotations

import argparse
import pickle
import traceback
from pathlib import Path

from engine import checkpoint
from engine.cli._checks import _fail

# errors of reading a run's files that a replay reports in one line (exit 2)
_UNREADABLE = (OSError, pickle.UnpicklingError, EOFError)


def _replay(args: argparse.Namespace) -> int:
    from engine.replaying import ReplayError, replay

    data = None
    try:
        if args.data:
            data = _import_data(args.data)
        _check_run_dir(Path(args.run_dir))
        report = replay(
            args.run_dir,
            args.from_step,
            args.to_step,
            trust_code=args.trust_code,
            detect_anomaly=args.detect_anomaly,
            data=data,
        )
    except (ReplayError, checkpoint.CheckpointError, ValueError) as e:
        return _fail(str(e))
    except ImportError as e:
        return _fail(
            f"{args.run_dir}: the run's pickled code imports {e.name or 'a module'!r}, which "
            f"cannot be imported here ({e}); install it or add its directory to PYTHONPATH"
        )
    except AttributeError as e:
        if not str(e).startswith("Can't get attribute"):  # not unpickling: a bug, show it
            traceback.print_exc()
            return _fail(f"replay failed: {type(e).__name__}: {e}")
        return _fail(
            f"{args.run_dir}: unpickling the run's code failed ({e}): the module changed since "
            "the run; restore the definition it names"
        )
    except _UNREADABLE as e:
        return _fail(f"{args.run_dir} cannot be read: {type(e).__name__}: {e}")
    except Exception as e:  # the run's own code failed: its traceback is what helps
        traceback.print_exc()
        return _fail(f"replay failed: {type(e).__name__}: {e}")
    print(report)
    return 0 if report.identical else 1


def _check_run_dir(root: Path) -> None:
    """Refuse, naming the problem, a path that is not a readable run directory or whose journal
    is damaged (replay itself would fail on it with a less precise error)."""
    from engine.listeners.journal import JOURNAL, Journal

    if not root.exists():
        raise ValueError(f"{root}: no such directory; pass a run directory (it holds {JOURNAL})")
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory; pass a run directory (it holds {JOURNAL})")
    journal = root / JOURNAL
    if not journal.is_file():
        return  # replay says what a run directory is
    # a line that is not JSON raises, naming it (an incomplete last line is left out, warned)
    numbered = Journal.read_numbered(root)
    for number, line in numbered:
        if not isinstance(line, dict) or not isinstance(line.get("step"), int):
            raise ValueError(
                f"{journal}: line {number} has no integer 'step'; the journal is damaged"
            )
    if not numbered:
        raise ValueError(f"{journal} is empty: the run journaled no step; nothing to replay")


def _import_data(spec: str) -> object:
    """``module:attr`` -> the object (called if callable): the training data for a replay."""
    import importlib

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--data {spec!r}: pass MODULE:ATTRIBUTE, e.g. mypkg.data:train_loader")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"--data {spec!r}: cannot import {module_name!r} ({e}); install it or add its "
            "directory to PYTHONPATH"
        ) from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"--data {spec!r}: module {module_name!r} has no {attr!r}") from None
    return obj() if callable(obj) else obj
