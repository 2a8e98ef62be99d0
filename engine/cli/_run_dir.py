"""``engine inspect RUN_DIR``: what a run directory holds and how large each part is, read
without unpickling anything (the pickles are described from their opcodes: no code runs).
"""

from __future__ import annotations

import json
import pickletools
from pathlib import Path
from typing import Any

_WHAT = {
    "journal.jsonl": "the journal",
    "config.json": "the Trainer's flags",
    "task.pkl": "the task (its functions, pickled by value where they are the script's)",
    "model.pkl": "the model's structure (no weights)",
    "data.pkl": "the training data",
    "hparams.yaml": "the hyperparameters",
    "metrics.csv": "CSVLogger's rows",
}


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _strings_and_bytes(data: bytes) -> tuple[list[str], list[int]]:
    """The globals a pickle names (``module.name``) and the sizes of its byte strings."""
    names: list[str] = []
    sizes: list[int] = []
    recent: list[str] = []
    for op, arg, _ in pickletools.genops(data):
        if isinstance(arg, str):
            recent = [*recent[-1:], arg]
        if op.name == "GLOBAL" and isinstance(arg, str):
            names.append(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL" and len(recent) == 2:
            names.append(".".join(recent))
        elif isinstance(arg, bytes | bytearray):
            sizes.append(len(arg))
    return names, sizes


def describe_pickle(path: Path) -> str:
    """What a ``dumps_code`` pickle holds, from its opcodes: the first class of the user's (or
    a library's) it names, and how much of it is byte strings (tensor storages)."""
    try:
        outer = path.read_bytes()
        _, sizes = _strings_and_bytes(outer)
        # the payload: (format, sources, inner pickle); the inner is its largest byte string
        inner = max(
            (a for _, a, _ in pickletools.genops(outer) if isinstance(a, bytes | bytearray)),
            key=len,
            default=b"",
        )
        names, sizes = _strings_and_bytes(bytes(inner))
    except Exception as e:  # a damaged or foreign file: say so, do not fail the listing
        return f"not readable as engine's pickle ({type(e).__name__})"
    skip = ("cloudpickle", "copyreg", "builtins", "collections", "_codecs", "torch._utils")
    own = [n for n in names if not n.startswith(skip)]
    first = own[0] if own else "plain data"
    tensors = sum(1 for n in names if n.endswith("_rebuild_tensor_v2"))
    data = sum(s for s in sizes if s > 1024)
    held = f", holding tensors ({data / 1024:.1f} KiB of their data)" if tensors else ""
    return f"{first}{held}"


def describe_data(path: Path) -> dict[str, Any]:
    """How ``data.pkl`` records the training data, from its opcodes: ``recorded`` (``"by
    reference"``: the data source's class and arguments, which a replay calls; ``"pickled"``;
    or ``"pickled, datasets by reference"``: a loader pickled with its datasets recorded by
    reference), ``references`` (those calls, ``module.Class(name=value, ...)``) and
    ``holds`` (the line ``engine inspect`` prints)."""
    from engine.checkpoint._data import references

    try:
        found = references(path.read_bytes())
    except Exception as e:  # a damaged or foreign file: say so, do not fail the listing
        return {"holds": f"not readable as engine's pickle ({type(e).__name__})"}
    calls = [text for _, text in found]
    if any(where == "the data source" for where, _ in found):
        return {
            "recorded": "by reference",
            "references": calls,
            "holds": f"by reference: {'; '.join(calls)} (a replay makes it again)",
        }
    held = f"pickled: {describe_pickle(path)}"
    if not calls:
        return {"recorded": "pickled", "references": [], "holds": held}
    return {
        "recorded": "pickled, datasets by reference",
        "references": calls,
        "holds": f"{held}; by reference in it: {'; '.join(calls)} (a replay makes it again)",
    }


def inspect_run_dir(path: Path) -> dict[str, Any]:
    """A run directory's parts: each file and checkpoint with its size, the journal's starts
    and last step, the flags' world size and precision."""
    files = []
    for p in sorted(path.iterdir()):
        entry: dict[str, Any] = {"name": p.name, "bytes": _size(p)}
        if p.is_dir():
            entry["kind"] = "checkpoints" if p.name == "checkpoints" else "directory"
            if p.name == "checkpoints":
                entry["checkpoints"] = sorted(c.name for c in p.iterdir() if c.is_dir())
            elif (p / "meta.json").is_file():
                entry["kind"] = "checkpoint"
        else:
            entry["kind"] = _WHAT.get(p.name, "tensorboard events" if "tfevents" in p.name else "")
            if p.name == "data.pkl":
                entry.update(describe_data(p))
            elif p.suffix == ".pkl":
                entry["holds"] = describe_pickle(p)
        files.append(entry)
    out: dict[str, Any] = {
        "run_dir": str(path),
        "bytes": sum(f["bytes"] for f in files),
        "files": files,
    }
    journal = path / "journal.jsonl"
    if journal.is_file():
        lines = []
        for text in journal.read_text(errors="replace").splitlines():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                continue
        steps = [x["step"] for x in lines if isinstance(x, dict) and "step" in x]
        out["journal"] = {
            "lines": len(lines),
            "starts": [x.get("step") for x in lines if isinstance(x, dict) and x.get("start")],
            "last_step": max(steps) if steps else None,
            "ended": any(isinstance(x, dict) and x.get("end") for x in lines),
        }
    config = path / "config.json"
    if config.is_file():
        try:
            flags = json.loads(config.read_text())
            out["config"] = {k: flags.get(k) for k in ("world_size", "strategy", "precision")}
        except json.JSONDecodeError:
            out["config"] = None
    return out


def print_run_dir(info: dict[str, Any]) -> None:
    print(f"run directory   {info['run_dir']}")
    print(f"size            {info['bytes'] / 2**20:.2f} MiB in {len(info['files'])} entries")
    j = info.get("journal")
    if j:
        starts = ", ".join(str(s) for s in j["starts"]) or "none"
        print(
            f"journal         {j['lines']} lines; fit started at step {starts}; last step "
            f"{j['last_step']}{'; ended' if j['ended'] else ''}"
        )
    c = info.get("config")
    if c:
        print(
            f"config          world size {c['world_size']}, strategy {c['strategy']}, "
            f"precision {c['precision']}"
        )
    for f in info["files"]:
        size = f"{f['bytes'] / 1024:9.1f} KiB"
        what = f["kind"]
        if f.get("checkpoints") is not None:
            what = f"{len(f['checkpoints'])} checkpoints: {', '.join(f['checkpoints'])}"
        if f.get("holds"):
            what = f"{what}: {f['holds']}"
        print(f"  {f['name']:<34} {size}  {what}")
