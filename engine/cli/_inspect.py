"""``engine inspect CKPT``: a checkpoint's counters, metrics, layout and integrity, printed (or
one JSON object), and a file that is no engine checkpoint (a Lightning ``.ckpt``, a
``torch.save`` file) named for what it is; ``engine inspect RUN_DIR``: what a run directory
holds (``_run_dir``)."""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from pathlib import Path

from engine import checkpoint
from engine.cli._checks import _fail


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
    try:  # a run directory (its journal, no meta.json); unreadable: the checkpoint path says why
        run_dir = (
            path.is_dir()
            and (path / "journal.jsonl").is_file()
            and not (path / checkpoint.META).exists()
        )
    except OSError:
        run_dir = False
    if run_dir:
        from engine.cli._run_dir import inspect_run_dir, print_run_dir

        try:
            info = inspect_run_dir(path)
        except OSError as e:
            return _fail(f"{path} cannot be read: {e.strerror or e}")
        if args.json:
            print(json.dumps(info, indent=2, sort_keys=True))
        else:
            print_run_dir(info)
        return 0
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
