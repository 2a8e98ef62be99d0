"""The ``engine`` command: ``fit`` / ``validate`` / ``test`` / ``predict`` from config files,
``demo``, ``inspect CKPT`` and ``replay RUN_DIR`` (see docs/cli.md)."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import traceback
import zipfile
from pathlib import Path

from engine import checkpoint
from engine._cli_config import STAGES

__all__ = ["main"]


def _lightning_version(path: Path) -> str | None:
    """The pytorch-lightning version a Lightning ``.ckpt`` names, read from the opcodes of its
    pickle without unpickling anything (nothing in the file runs); ``None`` for another file.

    A ``.ckpt`` is ``torch.save``'s zip of a dict whose key ``pytorch-lightning_version`` is
    followed by the version's text.
    """
    import pickletools

    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.rsplit("/", 1)[-1] == "data.pkl"]
            if not pickles:
                return None
            data = archive.read(pickles[0])
    except (zipfile.BadZipFile, KeyError, EOFError):
        return None
    previous = None
    try:
        for _, arg, _ in pickletools.genops(data):
            if isinstance(arg, str):
                if previous == "pytorch-lightning_version":
                    return arg
                previous = arg
    except ValueError:  # a damaged pickle: not something to name
        return None
    return None


def _not_a_checkpoint_dir(path: Path) -> str | None:
    """Why ``path`` is not an engine checkpoint when it is no directory, else ``None``.

    Raises:
        OSError: ``path`` cannot be read (no permission on it or a directory above it).
    """
    if not path.exists():
        return f"{path}: no such file or directory"
    if path.is_dir():
        return None
    with open(path, "rb"):  # unreadable: the OSError says why
        pass
    version = _lightning_version(path)
    if version is not None:
        return (
            f"{path} is a Lightning checkpoint (pytorch-lightning {version}), not an engine "
            f"checkpoint: start from its weights with engine.checkpoint.from_lightning("
            f"{str(path)!r}, task.init(model)) (docs/checkpoints.md)"
        )
    if zipfile.is_zipfile(path):
        return (
            f"{path} is a torch.save file, not an engine checkpoint (a directory holding "
            f"{checkpoint.META}); engine.checkpoint.from_lightning reads a state dict's weights"
        )
    return f"{path} is a file, not an engine checkpoint (a directory holding {checkpoint.META})"


def _inspect(args: argparse.Namespace) -> int:
    path = Path(args.path)
    try:
        refused = _not_a_checkpoint_dir(path)
        if refused is not None:
            return _fail(refused)
        info = checkpoint.inspect(path)
    except checkpoint.CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        # 1: a checkpoint that fails verification (its meta.json too); 2: not a checkpoint,
        # or one that cannot be read
        unreadable = isinstance(e.__cause__, OSError)
        try:
            has_meta = (path / checkpoint.META).is_file()
        except OSError:
            has_meta = False
        return 1 if has_meta and not unreadable else 2
    except OSError as e:  # no permission on the path, or on a file or directory inside it
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
        return _fail(
            f"{path} cannot be read: {e.strerror or e}{where}; check its permissions "
            "(ls -l) or run as a user who may read it"
        )
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        print(f"checkpoint      {args.path}")
        print(
            f"step            {info['step']} (epoch {info['epoch']}, batch {info['batch_idx']}, "
            f"micro-step {info['micro_step']})"
        )
        print(f"seed            {info['seed']}")
        print(f"parameters      {info['num_params']:,}")
        if info.get("weights_only"):
            print("contents        the model's weights only (not resumable)")
        print(f"size            {info['size_bytes'] / 2**20:.2f} MiB")
        print(
            f"format          v{info['format_version']} (engine {info['engine_version']}, "
            f"torch {info['torch_version']})"
        )
        if info.get("layout") == "sharded":
            _print_sharded(info)
        for k, v in sorted((info["metrics"] or {}).items()):
            print(f"metric          {k} = {v}")
        if info["fingerprint"]:
            print(f"fingerprint     {info['fingerprint']}")
        for i, what in enumerate(info.get("checked") or []):
            print(f"{'checked' if i == 0 else '':<16}{what}")
        print(
            "checksums       "
            + ("all verify" if info["verified"] else f"FAILED: {info['problem']}")
        )
    return 0 if info["verified"] else 1


def _print_sharded(info: dict) -> None:
    """The layout, and each parameter as the index holds it (where each chunk lies) beside
    what meta.json records of it."""
    from engine.checkpoint._report import chunk_text

    tensors = info.get("tensors") or {}
    index = info.get("index")
    print(
        f"layout          sharded over {info['world_size']} ranks "
        f"(torch.distributed.checkpoint), {len(tensors)} tensors in meta.json"
    )
    if index is None:
        print("index           unreadable (see the checks below)")
    else:
        chunks = [c for d in index.values() for c in d["chunks"]]
        files = sorted({str(c["file"]) for c in chunks})
        print(
            f"index           {len(index)} tensors, {len(chunks)} chunks in "
            f"{len(files)} files ({', '.join(files)})"
        )
    for key, d in sorted(tensors.items()):
        if key.startswith("params/"):
            dims = "x".join(map(str, d["shape"])) or "scalar"
            placed = ", ".join(d["placements"] or ["the same on every rank"])
            print(f"parameter       {key[7:]} {dims} {d['dtype']} ({placed})")
            held = (index or {}).get(key)
            if held is not None:
                where = ", ".join(chunk_text(c) for c in held["chunks"])
                dims = "x".join(map(str, held["shape"])) or "scalar"
                print(f"  in the index  {dims} {held['dtype']}: {where}")


# errors of reading a run's files that a replay reports in one line (exit 2)
_UNREADABLE = (OSError, pickle.UnpicklingError, EOFError)


def _replay(args: argparse.Namespace) -> int:
    from engine._replay import ReplayError, replay

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


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


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
        from engine._cli_config import run

        return run(argv[0], argv[1:])
    if argv and argv[0] == "demo":  # the script parses its own flags
        return _demo(argv[1:])
    parser = argparse.ArgumentParser(prog="engine", description="engine's command line")
    sub = parser.add_subparsers(dest="command", required=True)
    for stage, text in STAGES.items():  # listed here; parsed by engine._cli_config
        sub.add_parser(stage, help=f"{text} (engine {stage} --help)", add_help=False)
    sub.add_parser(
        "demo",
        help="train on scikit-learn's digits (examples/digits.py; engine demo --epochs 3)",
        add_help=False,
    )
    p = sub.add_parser("inspect", help="show a checkpoint's counters, metrics and integrity")
    p.add_argument("path", help="a checkpoint directory")
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
