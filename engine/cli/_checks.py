"""What the ``engine`` command checks so that a bad value is answered with one ``error:`` line
(exit status 2) and never a traceback: the bounds of a config's YAML, the values jsonargparse
lets through, and which exceptions are refusals whose message is the whole story.

A traceback is kept where it helps: an exception raised by the user's own code (the model, the
task, the data, a listener) or by a library engine calls, or an engine bug that is not one of
its ``raise`` statements.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_NODES",
    "ConfigTooLarge",
    "check_config_files",
    "check_ints",
    "check_root_dir",
    "check_seed",
    "install_yaml_loader",
    "one_line",
    "refusal",
    "yaml_nodes",
]

# A config is a page of hyperparameters. These bound what reading one may cost, so that a
# crafted file ("billion laughs": nine lines of nested aliases that expand to 10**9 nodes) is
# refused at once instead of after minutes of expansion; data belongs in files the datamodule
# reads, not in the config.
MAX_CONFIG_BYTES = 1 << 20  # a config file, or the text of one --KEY=VALUE
MAX_CONFIG_NODES = 100_000  # YAML nodes, once every alias is expanded
YAML_MODE = "engine_yaml"  # the jsonargparse parser mode whose loader checks both bounds

_INT64 = 2**63


class ConfigTooLarge(yaml.YAMLError):
    """A config over :data:`MAX_CONFIG_BYTES`, or over :data:`MAX_CONFIG_NODES` once its
    aliases are expanded, or whose aliases refer to themselves."""


def yaml_nodes(text: str, limit: int | None = None) -> int:
    """The number of nodes of the YAML ``text`` with every alias expanded, counted without
    expanding anything: each distinct node is visited once and an alias adds the size of what
    it names, so a "billion laughs" costs as many steps as it has lines.

    Counting stops, returning ``limit + 1``, as soon as the total passes ``limit``.

    Raises:
        ConfigTooLarge: an alias inside the node it names (a structure that contains itself).
        yaml.YAMLError: ``text`` is not YAML.

    Example:
        >>> yaml_nodes("a: [1, 2]")  # the mapping, the key, the list, its two items
        5
        >>> yaml_nodes("a: &x [1, 2]\\nb: *x")  # the alias adds the three nodes it names
        9
    """
    try:
        root = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except RecursionError:
        raise ConfigTooLarge("the config nests too deeply to be read") from None
    if root is None:
        return 0
    sizes: dict[int, int] = {}  # id(node) -> its expanded size, once known
    open_: set[int] = set()  # the nodes whose children are being sized
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        if children_done:
            open_.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            if limit is not None and sizes[key] > limit:
                return limit + 1
            continue
        if key in open_:
            raise ConfigTooLarge("an alias of the config refers to a node that contains it")
        open_.add(key)
        stack.append((node, True))
        for child in children:
            if id(child) in open_:
                raise ConfigTooLarge("an alias of the config refers to a node that contains it")
            if id(child) not in sizes:
                stack.append((child, False))
    return sizes[id(root)]


def _bounded_load(text: str) -> Any:
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigTooLarge(
            f"the config is {len(text):,} characters, more than the {MAX_CONFIG_BYTES:,} a "
            "config may hold; keep data in files your datamodule reads"
        )
    if yaml_nodes(text, MAX_CONFIG_NODES) > MAX_CONFIG_NODES:
        raise ConfigTooLarge(
            f"the config describes more than {MAX_CONFIG_NODES:,} YAML nodes once its aliases "
            "are expanded (a 'billion laughs'?); keep data in files your datamodule reads"
        )
    return _plain_yaml_load(text)


def _plain_yaml_load(text: str) -> Any:
    from jsonargparse import get_loader

    return get_loader("yaml")(text)


def install_yaml_loader() -> str:
    """Register the bounded YAML loader with jsonargparse; the parser mode that uses it."""
    from jsonargparse import set_loader

    set_loader(YAML_MODE, _bounded_load, exceptions=(yaml.YAMLError,))
    return YAML_MODE


def _config_paths(argv: list[str]) -> Iterator[str]:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            yield argv[i + 1]
        elif arg.startswith("--config="):
            yield arg.removeprefix("--config=")


def check_config_files(argv: list[str]) -> str | None:
    """A ``--config`` file over :data:`MAX_CONFIG_BYTES`, named before it is read; else
    ``None`` (a missing file is the parser's to report)."""
    for path in _config_paths(argv):
        try:
            size = os.stat(path).st_size
        except OSError:
            continue
        if size > MAX_CONFIG_BYTES:
            return (
                f"--config {path}: the file is {size:,} bytes, more than the "
                f"{MAX_CONFIG_BYTES:,} a config may hold; keep data in files your datamodule reads"
            )
    return None


def check_seed(seed: Any) -> str | None:
    """``seed_everything``: an int in [0, 2**63), the range of a ``TrainState``'s seed."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _INT64:
        return (
            f"seed_everything: must be an int in [0, 2**63) (got {seed!r}); it seeds torch, "
            "random and numpy and is the TrainState's seed"
        )
    return None


def _ints(value: Any, key: str) -> Iterator[tuple[str, int]]:
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        yield key, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _ints(v, f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _ints(v, f"{key}[{i}]")


def check_ints(section: str, values: Mapping[str, Any]) -> str | None:
    """An int of ``values`` outside int64: nothing downstream (torch, C, the journal's readers)
    can hold it, so it is refused here rather than overflowing mid-run."""
    for name, value in values.items():
        for key, number in _ints(value, f"{section}.{name}"):
            if not -_INT64 <= number < _INT64:
                return (
                    f"{key}: {number} is out of range; integers must lie in "
                    "[-2**63, 2**63) (a 64-bit int)"
                )
    return None


def check_root_dir(value: Any) -> str | None:
    """``trainer.default_root_dir``: one directory path, that is or can become a directory.

    jsonargparse keeps ``--trainer.default_root_dir=[a, b]`` as the text ``"[a, b]"``; a
    path that reads as a YAML list or mapping is refused rather than made a directory."""
    if value is None:
        return None
    key = "trainer.default_root_dir"
    if not isinstance(value, (str, os.PathLike)):
        return f"{key}: expected one directory path (got {type(value).__name__} {value!r})"
    text = os.fspath(value)
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        parsed = text
    if isinstance(parsed, (list, dict)) or not text.strip():
        what = type(parsed).__name__ if text.strip() else "an empty path"
        return f"{key}: expected one directory path (got {text!r}, {what})"
    path = Path(text)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            where = "it" if existing == path else f"its parent {existing}"
            return f"{key}: {text!r} cannot be a directory: {where} is a file; pass a directory"
    except OSError as e:
        return f"{key}: {text!r} cannot be used: {e}"
    return None


def one_line(message: str) -> str:
    """jsonargparse's indented, several-line messages as one line."""
    parts = [line.strip() for line in str(message).splitlines() if line.strip()]
    out = ""
    for part in parts:
        out += part if not out else (" " if out.endswith(":") else "; ") + part
    return out


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


_ENGINE = str(Path(__file__).resolve().parent.parent)  # the engine package, above cli/
_STDLIB = str(Path(sysconfig.get_paths()["stdlib"]).resolve())


def _package_dir(name: str) -> str | None:
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    return str(Path(file).resolve().parent) if file else None


def _inside(filename: str, roots: tuple[str, ...]) -> bool:
    try:
        path = str(Path(filename).resolve())
    except (OSError, ValueError):
        return False
    return any(path == r or path.startswith(r + os.sep) for r in roots)


def refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is a refusal that engine (or jsonargparse, the config parser) raised
    itself: a ``raise`` statement in their code, reached without passing through the user's
    code or another library. Its message says what, the value and what to do, so a traceback
    would add nothing. Anything else keeps its traceback."""
    if not isinstance(exc, Exception):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    ours = tuple(d for d in (_ENGINE, _package_dir("jsonargparse")) if d)
    if not all(_inside(f.filename, (*ours, _STDLIB)) for f in frames):
        return False
    last = frames[-1]
    return _inside(last.filename, ours) and (last.line or "").lstrip().startswith("raise")
