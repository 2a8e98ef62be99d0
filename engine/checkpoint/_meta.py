"""A checkpoint's ``meta.json`` (private): written with a checksum of its own bytes, read back
verified and checked against its schema.

Everything in ``meta.json`` steers a resume (the counters, the seed, the listeners' states, the
checksum of ``tensors.pt``), so from format version 4 the file carries the XXH3-128 of its own
bytes as its last member::

    {
      "batch_idx": 3,
      ...
      "torch_version": "2.13.0",
      "meta_checksum": "xxh3-128:<32 hex digits>"
    }

The digest covers every byte before ``,\\n  "meta_checksum"``; the bytes after the digest are
fixed (``"\\n}\\n"``). A changed, missing or added byte anywhere in the file fails the check,
whitespace included. Reading checks the format and version first (so that a newer file says
"upgrade engine"), then the schema (so that a hand-edited value is named with its key and the
type expected), then the checksum.

``files`` names each data file with its checksum. A name must be a plain file name (no
separator, no ``..``, not absolute: a checkpoint names only its own files), and from format
version 5 ``sizes`` records each file's size in bytes, so that a file of another size is refused
before it is hashed. Older versions have no ``sizes``: they still load, their files' names
checked, their sizes not.

Format version 6 is the sharded layout (``"layout": "sharded"``, written by every rank of a
process group through ``torch.distributed.checkpoint``, see ``engine/parallel/_dcp.py``): its data
files lie in the ``shards/`` subdirectory and are named ``shards/<plain name>``; it records the
``world_size`` it was saved on and each tensor's global shape, dtype and placement
(``tensors``). An ordinary checkpoint (one ``tensors.pt``) is still written as version 5.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import xxhash

from engine.errors import CheckpointError

__all__: list[str] = []

FORMAT_VERSION = 5  # 5: the size of each data file ("sizes")
SHARDED_FORMAT_VERSION = 6  # 6: the sharded layout ("layout": "sharded"), shards/ files
SHARDED, SHARDS = "sharded", "shards"  # the layout's name; the subdirectory of its data files
CHECKSUM_KEY = "meta_checksum"
_HASH = "xxh3-128"


def encode(meta: Mapping[str, Any]) -> bytes:
    """``meta`` as the bytes of ``meta.json``, its own checksum last.

    Example:
        >>> raw = encode({"format": "engine.checkpoint", "step": 3})
        >>> print(raw.decode())  # doctest: +ELLIPSIS
        {
          "format": "engine.checkpoint",
          "step": 3,
          "meta_checksum": "xxh3-128:..."
        }
        <BLANKLINE>
        >>> decode(raw, Path("meta.json"))
        Traceback (most recent call last):
        ...
        engine.errors.CheckpointError: meta.json: 'format_version' must be an int >= 1 (got None)...
    """
    if not meta:
        raise ValueError("meta.json cannot be empty")
    body = json.dumps(dict(meta), indent=2, sort_keys=True)
    head = body[: -len("\n}")].encode("ascii")  # json.dumps escapes every non-ASCII character
    return head + _tail(f"{_HASH}:{xxhash.xxh3_128(head).hexdigest()}")


def _tail(checksum: str) -> bytes:
    return f',\n  "{CHECKSUM_KEY}": "{checksum}"\n}}\n'.encode("ascii")


def _verify(raw: bytes, path: Path, recorded: str) -> None:
    """Check ``recorded``, the checksum that :func:`encode` put at the end of ``raw``."""
    if not recorded.isascii():
        raise CheckpointError(f"{path}: {CHECKSUM_KEY!r} is not ASCII; the file is damaged")
    tail = _tail(recorded)
    if not raw.endswith(tail):
        raise CheckpointError(
            f"{path}: the file does not end with its {CHECKSUM_KEY!r}; it is damaged or was edited"
        )
    scheme, _, digest = recorded.partition(":")
    actual = xxhash.xxh3_128(raw[: -len(tail)]).hexdigest()
    if scheme != _HASH or digest != actual:
        raise CheckpointError(
            f"{path}: checksum check failed ({recorded[:40]!r} recorded, {_HASH}:{actual[:16]}... "
            "computed); the file is damaged or was edited"
        )


def decode(raw: bytes, path: Path) -> dict[str, Any]:
    """The values of ``meta.json`` (its bytes ``raw``), verified: format, version, schema and,
    from version 4, checksum. Non-finite floats come back as floats.

    Raises:
        CheckpointError: naming ``path``, the key and what was expected.
    """
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path}: not valid JSON ({e}); the file is damaged") from e
    if not isinstance(doc, dict):
        raise CheckpointError(
            f"{path}: holds a JSON {type(doc).__name__}, not an object; the file is damaged"
        )
    if doc.get("format") != "engine.checkpoint":
        raise CheckpointError(
            f"{path}: not an engine checkpoint ('format' is {doc.get('format')!r})"
        )
    version = doc.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(
            f"{path}: 'format_version' must be an int >= 1 (got {version!r}); the file is damaged"
        )
    _layout_agrees(doc, path)  # before "newer": an edited layout is no newer format
    sharded = doc.get("layout") == SHARDED
    newest = SHARDED_FORMAT_VERSION if sharded else FORMAT_VERSION
    if version > newest:
        raise CheckpointError(
            f"{path}: format version {version} is newer than this engine reads "
            f"({newest}{' for a sharded checkpoint' if sharded else ''}); upgrade engine"
        )
    if sharded and version < SHARDED_FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: 'layout' is 'sharded' in a format version {version} file (sharded "
            f"checkpoints are version {SHARDED_FORMAT_VERSION}); the file is damaged or was edited"
        )
    try:
        meta = _decode_floats(doc)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: a '$float' value is not a float ({e}); damaged") from e
    for key, (check, expected, since, required) in _SCHEMA.items():
        if key not in meta:
            if required and version >= since:
                raise CheckpointError(
                    f"{path}: {key!r} is missing (expected {expected}); the file is damaged"
                )
            continue
        problem = check(meta[key])
        if problem is not None:
            where = key if problem is True else f"{key}{problem}"
            raise CheckpointError(
                f"{path}: {where!r} must be {expected} (got {_shown(meta, key, problem)}); the "
                "file is damaged or was edited"
            )
    main = f"{SHARDS}/.metadata" if sharded else "tensors.pt"
    if main not in meta["files"]:
        raise CheckpointError(
            f"{path}: 'files' must name {main!r} (got {sorted(meta['files'])}); the file is "
            "damaged or was edited"
        )
    for name in meta["files"]:  # before anything opens them
        if not (shard_name(name) if sharded else plain_name(name)):
            raise CheckpointError(not_plain(path, name))
    if "sizes" in meta and set(meta["sizes"]) != set(meta["files"]):
        raise CheckpointError(
            f"{path}: 'sizes' must name the files of 'files' ({sorted(meta['files'])}; got "
            f"{sorted(meta['sizes'])}); the file is damaged or was edited"
        )
    recorded = meta.pop(CHECKSUM_KEY, None)
    if version >= 4:
        _verify(raw, path, recorded)
    return meta


def _layout_agrees(doc: Mapping[str, Any], path: Path) -> None:
    """Refuse a ``layout`` that the files contradict: a sharded checkpoint's files (under
    ``shards/``) with another layout, or ``tensors.pt`` alone with ``"sharded"``."""
    files = doc.get("files")
    if not isinstance(files, dict):
        return  # the schema names what is wrong with it
    names = sorted(str(n) for n in files)
    shards = [n for n in names if n.startswith(f"{SHARDS}/")]
    claimed = doc.get("layout")
    full = "tensors.pt" in files
    if (claimed != SHARDED and shards and not full) or (claimed == SHARDED and full and not shards):
        said = "no 'layout' (a full checkpoint)" if claimed is None else f"'layout' {claimed!r}"
        kind = "a sharded checkpoint's" if shards else "a full checkpoint's"
        raise CheckpointError(
            f"{path}: {said}, but its 'files' are {kind} ({names[:3]}"
            f"{', ...' if len(names) > 3 else ''}): the layout and the files disagree; the "
            "checkpoint was edited. Refused"
        )


def _decode_floats(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"$float"}:
            return float(x["$float"])
        return {k: _decode_floats(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_decode_floats(v) for v in x]
    return x


def _shown(meta: Mapping[str, Any], key: str, problem: Any) -> str:
    value = meta[key]
    if isinstance(problem, str) and isinstance(value, dict):  # an entry: problem is "[name]"
        value = value[json.loads(problem[1:-1])]
    text = repr(value)
    return (
        f"{text[:60]}..., a {type(value).__name__}"
        if len(text) > 60
        else f"{text}, a {type(value).__name__}"
    )


# Each check returns None when the value is right, True when it is wrong, or "[<entry>]" naming
# the entry of a dict that is wrong.
Check = Callable[[Any], Any]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _range(low: int, high: float = math.inf) -> Check:
    return lambda v: None if _is_int(v) and low <= v < high else True


def _of(*types: type) -> Check:
    def check(v: Any) -> Any:
        if isinstance(v, bool) and bool not in types:
            return True
        return None if isinstance(v, types) else True

    return check


def _dict_of(value: Check | None) -> Check:
    def check(v: Any) -> Any:
        if not isinstance(v, dict):
            return True
        for k, x in v.items():
            if value is not None and value(x) is not None:
                return f"[{json.dumps(k)}]"
        return None

    return check


def _trees(v: Any) -> Any:
    if not isinstance(v, dict):
        return True
    wrong = [k for k in v if k not in ("extra", "precision")]
    return f"[{json.dumps(wrong[0])}]" if wrong else None


def _files(v: Any) -> Any:
    if not isinstance(v, dict) or not v:
        return True
    return _dict_of(_of(str))(v)


def _described(v: Any) -> Any:
    """``tensors`` of a sharded checkpoint: ``{key: {"shape": [ints], "dtype": str,
    "placements": [str] or null}}``."""
    if not isinstance(v, dict):
        return True
    for k, d in v.items():
        if not (
            isinstance(d, dict)
            and isinstance(d.get("shape"), list)
            and all(_is_int(n) and n >= 0 for n in d["shape"])
            and isinstance(d.get("dtype"), str)
            and (d.get("placements") is None or isinstance(d.get("placements"), list))
        ):
            return f"[{json.dumps(k)}]"
    return None


def plain_name(name: Any) -> bool:
    """Whether ``name`` names a file directly inside the checkpoint directory: no separator,
    not ``.`` or ``..``, not absolute, no NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in ("/", "\\", "\0"))
        and not os.path.isabs(name)
    )


def shard_name(name: Any) -> bool:
    """Whether ``name`` names a file of a sharded checkpoint: ``shards/<plain name>``."""
    if not isinstance(name, str):
        return False
    head, sep, tail = name.partition("/")
    return bool(sep) and head == SHARDS and plain_name(tail)


def not_plain(path: Path, name: str) -> str:
    return (
        f"{path}: 'files' names {name!r}, which is not a plain file name inside the checkpoint "
        "directory (no '/', no '..', not absolute); a checkpoint names only its own files: the "
        "file was edited. Refused without reading it"
    )


_NAT = "an int >= 0"
_SCALAR = _of(int, float, bool, str, type(None))
# key: (check, what is expected, the format version that introduced it, required from then on)
_SCHEMA: dict[str, tuple[Check, str, int, bool]] = {
    "engine_version": (_of(str), "a string", 1, True),
    "torch_version": (_of(str), "a string", 1, True),
    "step": (_range(0), _NAT, 1, True),
    "epoch": (_range(0), _NAT, 1, True),
    "batch_idx": (_range(0), _NAT, 1, True),
    "micro_step": (_range(0), _NAT, 1, True),
    "seed": (_range(0, 2**63), "an int in [0, 2**63)", 1, True),
    "num_params": (_range(0), _NAT, 1, True),
    "fingerprint": (_of(str, type(None)), "a string or null", 1, False),
    "has_grad_accum": (_of(bool), "true or false", 1, True),
    "weights_only": (_of(bool), "true or false", 3, False),
    "trees": (_trees, 'an object with keys "extra" and "precision"', 2, False),
    "opt_state_scalars": (_dict_of(_SCALAR), "an object of numbers, strings and nulls", 1, True),
    "metrics": (_dict_of(_of(int, float)), "an object of numbers", 1, True),
    "extra": (_dict_of(None), "an object", 1, True),
    "files": (_files, "an object of checksum strings by file name", 1, True),
    "sizes": (_dict_of(_range(0)), "an object of file sizes (ints >= 0)", 5, True),
    "layout": (lambda v: None if v == SHARDED else True, '"sharded"', 6, True),
    "world_size": (_range(1), "an int >= 1", 6, True),
    "tensors": (_described, "an object of tensor shapes, dtypes and placements", 6, True),
    CHECKSUM_KEY: (_of(str), "a checksum string", 4, True),
}
