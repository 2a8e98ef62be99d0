"""The ``engine`` command: ``engine inspect CKPT`` (more subcommands arrive with replay)."""

from __future__ import annotations

import argparse
import json
import sys

from engine import checkpoint

__all__ = ["main"]


def _inspect(args: argparse.Namespace) -> int:
    try:
        info = checkpoint.inspect(args.path)
    except checkpoint.CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``engine`` command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="engine", description="engine's command line")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="show a checkpoint's counters, metrics and integrity")
    p.add_argument("path", help="a checkpoint directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_inspect)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
