"""A sharded checkpoint reads only its own files (issue 24, items 1, 2 and 6a).

Each tampered checkpoint is made as an attacker would: a real sharded checkpoint (2 gloo ranks,
saved once for the module), its ``shards/.metadata`` rewritten with torch's own pickle of an
edited DCP ``Metadata``, and ``meta.json``'s checksums and sizes recomputed with engine's own
encoder so that every checksum verifies. Every loader (load, load_weights, export, verify,
inspect, ``engine inspect``, and one 2-rank load into DTensor templates) must refuse it with a
``CheckpointError`` naming the checkpoint, the index entry and the path, before any shard is
read; a failure inside torch.distributed.checkpoint never escapes as its ``CheckpointException``
(a ``BaseException``).
"""

from __future__ import annotations

import builtins
import dataclasses
import io
import os
import pickle
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import run_ranks
from test_checkpoint_sharded import _full_state, _init, _shard

from engine import checkpoint, cli
from engine.checkpoint import _meta
from engine.checkpoint._checksum import _checksum
from engine.errors import CheckpointError

pytestmark = pytest.mark.slow  # the module's checkpoint is saved by 2 spawned ranks

TIMEOUT = 60.0
INDEX = Path("shards") / ".metadata"


def _save(rank: int, path: str) -> None:
    checkpoint.save(_shard(_full_state(), _init()), path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("confined") / "c"
    run_ranks(_save, 2, str(path), timeout=TIMEOUT)
    return path


@pytest.fixture
def ckpt(saved: Path, tmp_path: Path) -> Path:
    """A fresh copy of the module's sharded checkpoint, at ``<tmp_path>/c``."""
    return Path(shutil.copytree(saved, tmp_path / "c"))


# --------------------------------------------------------------------------- the attacker


def _index(path: Path) -> Any:
    return pickle.loads((path / INDEX).read_bytes())  # the test's own file: trusted here


def _resign(path: Path, index: Any = None, **meta_changes: Any) -> None:
    """Write ``index`` (torch's pickle, as DCP writes it) and ``meta.json`` with every checksum
    and size recomputed, so that the tampered checkpoint 'verifies'."""
    if index is not None:
        (path / INDEX).write_bytes(pickle.dumps(index))
    meta = {**checkpoint.read_meta(path), **meta_changes}
    for name in meta["files"]:
        meta["files"][name] = _checksum(path / name)
        meta["sizes"][name] = (path / name).stat().st_size
    (path / "meta.json").write_bytes(_meta.encode(meta))


def _storage(index: Any, fqn: str, **changes: Any) -> Any:
    """``index`` with the storage records of ``fqn``'s chunks changed."""
    index.storage_data = {
        k: dataclasses.replace(v, **changes) if k.fqn == fqn else v
        for k, v in index.storage_data.items()
    }
    return index


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every path opened from now on (open, io.open, os.open)."""
    seen: list[str] = []

    def spy(real: Callable[..., Any]) -> Callable[..., Any]:
        def record(file: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(file, (str, os.PathLike)):
                seen.append(os.fspath(file))
            return real(file, *args, **kwargs)

        return record

    monkeypatch.setattr(builtins, "open", spy(builtins.open))
    monkeypatch.setattr(io, "open", spy(io.open))
    monkeypatch.setattr(os, "open", spy(os.open))
    yield seen


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    model.register_buffer("count", torch.zeros(4))
    model.register_parameter("scale", torch.nn.Parameter(torch.tensor(0.0)))
    return model


def _inspected(path: Path) -> None:
    info = checkpoint.inspect(path)
    if not info["verified"]:
        raise CheckpointError(info["problem"])


def _cli(path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code = cli.main(["inspect", str(path)])
    finally:
        sys.stdout, sys.stderr = saved
    if code != 0:
        raise CheckpointError(out.getvalue() + err.getvalue())


LOADERS: dict[str, Callable[[Path], Any]] = {
    "load": lambda p: checkpoint.load(p, _full_state(seed=9)),
    "load_weights": lambda p: checkpoint.load_weights(p, _model()),
    "export": lambda p: checkpoint.export(p, p.parent / "model.pt"),
    "verify": checkpoint.verify,
    "inspect": _inspected,
    "engine inspect": _cli,
}


# --------------------------------------------------------------------------- item 1


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("where", ["../../outside.distcp", "absolute"])
def test_an_index_naming_a_file_outside_the_checkpoint_is_refused_before_any_read(
    ckpt, where, loader, opened
):
    """The outside file holds the very bytes of a real shard: today every loader reads it (and
    export copies it into model.pt)."""
    outside = ckpt.parent / "outside.distcp" if where != "absolute" else ckpt.parent / "abs.bin"
    shutil.copyfile(ckpt / "shards" / "__0_0.distcp", outside)
    named = where if where != "absolute" else str(outside)
    index = _index(ckpt)
    moved = sorted({k.fqn for k, v in index.storage_data.items() if v.relative_path[:3] == "__0"})
    index.storage_data = {  # every chunk rank 0 wrote, now said to lie in the outside file
        k: dataclasses.replace(v, relative_path=named) if v.relative_path[:3] == "__0" else v
        for k, v in index.storage_data.items()
    }
    _resign(ckpt, index)
    opened.clear()
    with pytest.raises(CheckpointError) as caught:
        LOADERS[loader](ckpt)
    said = str(caught.value)
    assert str(ckpt) in said and str(ckpt / INDEX) in said, said
    assert f"relative_path {named!r} is not a plain file name of this checkpoint" in said, said
    assert any(f"entry {fqn!r}" in said for fqn in moved), said
    assert "refused before reading any shard" in said, said
    assert not [p for p in opened if "outside" in p or "abs.bin" in p or "distcp" in p], opened
    assert not (ckpt.parent / "model.pt").exists()


def _edit_dtype(index: Any) -> Any:
    md = index.state_dict_metadata["params/0.weight"]
    md.properties = dataclasses.replace(md.properties, dtype=torch.float64)
    return index


def _edit_shape(index: Any) -> Any:
    index.state_dict_metadata["params/0.weight"].size = torch.Size([6, 3])
    return index


def _drop_tensor(index: Any) -> Any:
    del index.state_dict_metadata["params/scale"]
    index.storage_data = {k: v for k, v in index.storage_data.items() if k.fqn != "params/scale"}
    return index


def _add_tensor(index: Any) -> Any:
    md = index.state_dict_metadata
    md["params/evil"] = md["params/0.bias"]
    return index


def _chunk(offsets: list[int], sizes: list[int]) -> Callable[[Any], Any]:
    def edit(index: Any) -> Any:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        chunks = index.state_dict_metadata["params/0.weight"].chunks
        chunks[1] = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        return index

    return edit


def _bytes_past_the_end(index: Any) -> Any:
    return _storage(index, "params/0.bias", offset=10**6)


def _transform(index: Any) -> Any:
    return _storage(index, "params/0.bias", transform_descriptors=["zstd"])


def _the_index_itself(index: Any) -> Any:
    return _storage(index, "params/0.bias", relative_path=".metadata")


def _no_storage(index: Any) -> Any:
    first = next(k for k in index.storage_data if k.fqn == "params/0.bias")
    del index.storage_data[first]
    return index


def _malformed(index: Any) -> Any:
    index.state_dict_metadata["params/0.weight"].size = 5  # an int where a torch.Size goes
    return index


EDITS = {
    "dtype": (_edit_dtype, "entry 'params/0.weight': dtype torch.float64, where meta.json records"),
    "shape": (_edit_shape, "entry 'params/0.weight': shape [6, 3], where meta.json records [5, 3]"),
    "a tensor missing": (_drop_tensor, "lacks some it does (['params/scale'])"),
    "a tensor added": (_add_tensor, "does not describe (['params/evil'])"),
    "a chunk outside the shape": (_chunk([3, 0], [3, 3]), "does not lie inside the tensor's"),
    "overlapping chunks": (
        _chunk([2, 0], [3, 3]),
        "(chunk at [0, 0]): the chunk overlaps the one at [2, 0]",
    ),
    "a chunk missing": (_chunk([3, 0], [1, 3]), "cover 12 of the 15 elements"),
    "bytes past the end": (_bytes_past_the_end, "outside the file"),
    "a stream transform": (_transform, "stream transforms ['zstd']"),
    "the index as a shard": (_the_index_itself, "relative_path '.metadata' is not a plain"),
    "a chunk not stored": (_no_storage, "no storage record for the chunk"),
    "a malformed entry": (_malformed, "entry (its structure): malformed (TypeError"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_index_that_disagrees_with_meta_json_is_refused_naming_the_entry(ckpt, edit, opened):
    change, message = EDITS[edit]
    _resign(ckpt, change(_index(ckpt)))
    opened.clear()
    for loader in ("load", "verify"):
        with pytest.raises(CheckpointError, match=r"the index and meta\.json disagree") as caught:
            LOADERS[loader](ckpt)
        assert message in str(caught.value), str(caught.value)
        assert str(ckpt / INDEX) in str(caught.value)
    assert not [p for p in opened if p.endswith(".distcp")], opened  # no shard read, not hashed


# --------------------------------------------------------------------------- item 2


def _swapped(ckpt: Path) -> None:
    """An index whose checks pass but whose bytes do not fit: each chunk of 0.weight (3x3 on
    rank 0, 2x3 on rank 1) stored where 0.bias's (3, 2) lies, and the reverse."""
    index = _index(ckpt)
    at = {(k.fqn, tuple(k.offset)): k for k in index.storage_data}
    data = index.storage_data
    for row in (0, 3):
        w, b = at[("params/0.weight", (row, 0))], at[("params/0.bias", (row,))]
        data[w], data[b] = data[b], data[w]
    _resign(ckpt, index)


@pytest.mark.parametrize("loader", ["load", "load_weights", "export"])
def test_a_failure_inside_dcp_is_a_checkpoint_error_in_one_line(ckpt, loader):
    _swapped(ckpt)
    checkpoint.verify(ckpt)  # nothing an index check can see
    with pytest.raises(CheckpointError) as caught:
        LOADERS[loader](ckpt)
    said = str(caught.value)
    assert said.startswith(f"{ckpt}: reading the shards failed in torch.distributed.checkpoint")
    assert len(said.splitlines()) == 1 and "Traceback" not in said, said
    assert isinstance(caught.value.__cause__, Exception), caught.value.__cause__
    assert not (ckpt.parent / "model.pt").exists()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_inside_dcp_passes_through_unchanged(ckpt, monkeypatch, interrupt):
    from torch.distributed.checkpoint import filesystem

    raised = interrupt()

    def stop(*args: Any, **kwargs: Any) -> None:
        raise raised

    monkeypatch.setattr(filesystem.FileSystemReader, "read_data", stop)
    with pytest.raises(interrupt) as caught:
        checkpoint.load(ckpt, _full_state(seed=9))
    assert caught.value is raised


def _load_tampered(rank: int, outside: str, swapped: str) -> list[str]:
    """Both tampered checkpoints loaded into this rank's DTensor template."""
    template = _shard(_full_state(seed=4), _init())
    said = []
    for path in (outside, swapped):
        try:
            checkpoint.load(path, template)
        except CheckpointError as e:
            said.append(str(e))
        else:
            said.append("loaded")
    return said


def test_two_ranks_refuse_a_tampered_index_with_a_checkpoint_error(saved, tmp_path):
    outside = Path(shutil.copytree(saved, tmp_path / "outside"))
    _resign(outside, _storage(_index(outside), "params/0.weight", relative_path="../../x.distcp"))
    swapped = Path(shutil.copytree(saved, tmp_path / "c"))
    _swapped(swapped)
    for said in run_ranks(_load_tampered, 2, str(outside), str(swapped), timeout=TIMEOUT):
        assert "relative_path '../../x.distcp' is not a plain file name" in said[0], said
        assert "entry 'params/0.weight'" in said[0], said
        assert said[1].startswith(f"{swapped}: reading the shards failed"), said
        assert len(said[1].splitlines()) == 1, said


# --------------------------------------------------------------------------- item 6a


@pytest.mark.parametrize("layout", ["full", None])
def test_a_sharded_checkpoint_relabelled_full_is_named_an_edit_not_a_newer_format(ckpt, layout):
    meta = checkpoint.read_meta(ckpt)
    if layout is None:
        del meta["layout"]
    else:
        meta["layout"] = layout
    (ckpt / "meta.json").write_bytes(_meta.encode(meta))
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load(ckpt, _full_state())
    said = str(caught.value)
    assert str(ckpt / "meta.json") in said and "the layout and the files disagree" in said, said
    assert "upgrade" not in said and "newer" not in said, said


def test_a_full_checkpoint_relabelled_sharded_is_named_an_edit(tmp_path):
    path = checkpoint.save(_full_state(), tmp_path / "full")
    meta = checkpoint.read_meta(path)
    for version in (5, 6):
        meta.update(layout="sharded", format_version=version)
        (path / "meta.json").write_bytes(_meta.encode(meta))
        with pytest.raises(CheckpointError, match="the layout and the files disagree"):
            checkpoint.load(path, _full_state())


# --------------------------------------------------------------------------- inspect


def test_inspect_says_what_it_checked_and_what_the_index_holds(ckpt, capsys):
    info = checkpoint.inspect(ckpt)
    assert info["verified"]
    assert [c.split(":")[0] for c in info["checked"]] == [
        "meta.json",
        "files",
        "sizes",
        "checksums",
        "index",
    ]
    held = info["index"]["params/0.weight"]
    assert held["shape"] == [5, 3] and held["dtype"] == "float32"
    assert [(c["file"], c["offsets"], c["sizes"]) for c in held["chunks"]] == [
        ("shards/__0_0.distcp", [0, 0], [3, 3]),
        ("shards/__1_0.distcp", [3, 0], [2, 3]),
    ]
    assert cli.main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "index           27 tensors, 43 chunks in 2 files" in out, out
    assert "shards/__0_0.distcp[0:3, 0:3], shards/__1_0.distcp[3:5, 0:3]" in out, out
    assert "index: shards/.metadata read without running code and checked against" in out
    # a tampered index: what it holds is shown, and why it is refused
    _resign(ckpt, _storage(_index(ckpt), "params/0.bias", relative_path="../../x"))
    info = checkpoint.inspect(ckpt)
    assert not info["verified"] and "relative_path '../../x'" in info["problem"]
    assert {c["file"] for c in info["index"]["params/0.bias"]["chunks"]} == {"shards/../../x"}
    assert cli.main(["inspect", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert "shards/../../x[0:3]" in out and "FAILED" in out, out


def test_a_shards_directory_linked_out_of_the_checkpoint_is_refused(ckpt, tmp_path):
    """Every shard a plain name of meta.json's, but shards/ itself a link to a directory
    elsewhere (a copy of the real shards): today it is read."""
    elsewhere = Path(shutil.move(ckpt / "shards", tmp_path / "elsewhere"))
    (ckpt / "shards").symlink_to(elsewhere, target_is_directory=True)
    for loader in ("load", "verify", "export"):
        with pytest.raises(CheckpointError, match=r"shards: a symbolic link to .*outside"):
            LOADERS[loader](ckpt)
    info = checkpoint.inspect(ckpt)  # nor does inspect show the index it leads to
    assert not info["verified"] and info["index"] is None
