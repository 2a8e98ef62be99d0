"""The ``engine`` command: ``engine inspect CKPT`` and ``engine replay RUN_DIR``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine import checkpoint

__all__ = ["main"]


def _inspect(args: argparse.Namespace) -> int:
    try:
        info = checkpoint.inspect(args.path)
    except checkpoint.CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        # 1: a checkpoint that fails verification (its meta.json too); 2: not a checkpoint
        return 1 if (Path(args.path) / checkpoint.META).is_file() else 2
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
        for k, v in sorted((info["metrics"] or {}).items()):
            print(f"metric          {k} = {v}")
        if info["fingerprint"]:
            print(f"fingerprint     {info['fingerprint']}")
        print(
            "checksums       "
            + ("all verify" if info["verified"] else f"FAILED: {info['problem']}")
        )
    return 0 if info["verified"] else 1


def _replay(args: argparse.Namespace) -> int:
    from engine._replay import ReplayError, replay

    data = None
    try:
        if args.data:
            data = _import_data(args.data)
        report = replay(
            args.run_dir,
            args.from_step,
            args.to_step,
            trust_code=args.trust_code,
            detect_anomaly=args.detect_anomaly,
            data=data,
        )
    except (ReplayError, checkpoint.CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.identical else 1


def _import_data(spec: str) -> object:
    """``module:attr`` -> the object (called if callable): the training data for a replay."""
    import importlib

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--data {spec!r}: pass MODULE:ATTRIBUTE, e.g. mypkg.data:train_loader")
    obj = getattr(importlib.import_module(module_name), attr)
    return obj() if callable(obj) else obj


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``engine`` command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="engine", description="engine's command line")
    sub = parser.add_subparsers(dest="command", required=True)
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
