"""Checkpoints: exact round trips (also across processes), atomic writes, and every fault
named — damaged files, foreign models, pickled code, a full disk, interrupted saves."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _procs
import pytest
import torch
import torch.nn.functional as F
import xxhash
from torch import nn

import engine as eg
from engine import checkpoint, optim
from engine.checkpoint import CheckpointError, _checksum, _files, _read, _save, _snapshot


def _model(seed: int = 0, width: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 3))


def _trained(accumulate: int = 1, calls: int = 5) -> eg.TrainState:
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, amsgrad=True))
    state = eg.TrainState.create(_model(), tx, seed=3, extra={"note": 1})
    step = eg.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]), tx, accumulate=accumulate)
    g = torch.Generator().manual_seed(0)
    for _ in range(calls):
        batch = (torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))
        state, _ = step(state, batch)
    return state


def _template() -> eg.TrainState:
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, amsgrad=True))
    return eg.TrainState.create(_model(seed=99), tx)


def test_round_trip_is_bitwise_including_a_half_full_accumulation_window(tmp_path):
    state = _trained(accumulate=3, calls=7)  # 2 optimizer steps, 1 micro-batch pending
    assert state.micro_step == 1 and state.grad_accum is not None
    path = checkpoint.save(state, tmp_path / "c", metrics={"val/loss": 0.5}, fingerprint=True)
    back = checkpoint.load(path, _template())
    assert back.fingerprint() == state.fingerprint() == checkpoint.read_meta(path)["fingerprint"]
    assert (back.step, back.epoch, back.batch_idx, back.micro_step, back.seed) == (2, 0, 7, 1, 3)
    assert checkpoint.read_meta(path)["metrics"] == {"val/loss": 0.5}
    assert not back.consumed and back.module is not None


def test_a_checkpoint_written_by_another_process_loads_bitwise(tmp_path):
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_checkpoint import _trained
        from engine import checkpoint
        s = _trained(calls=4)
        checkpoint.save(s, {str(tmp_path / "c")!r})
        print(s.fingerprint())
    """)
    out = _procs.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    back = checkpoint.load(tmp_path / "c", _template())
    assert back.fingerprint() == out.stdout.strip().splitlines()[-1]
    assert back.fingerprint() == _trained(calls=4).fingerprint()


def test_saving_again_replaces_the_checkpoint_and_leaves_no_temporaries(tmp_path):
    checkpoint.save(_trained(calls=1), tmp_path / "c")
    newer = _trained(calls=2)
    checkpoint.save(newer, tmp_path / "c")
    assert checkpoint.load(tmp_path / "c", _template()).fingerprint() == newer.fingerprint()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_tensor_file_is_named_with_the_failed_check(tmp_path, damage):
    path = checkpoint.save(_trained(), tmp_path / "c")
    f = path / "tensors.pt"
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    # a file of another size is refused by its size, before it is read
    failed = "checksum check failed" if damage == "flip" else "bytes, where meta.json records"
    with pytest.raises(CheckpointError, match=rf"tensors\.pt: .*{failed}"):
        checkpoint.load(path, _template())
    info = checkpoint.inspect(path)
    assert info["verified"] is False and failed in info["problem"]


def test_damaged_or_missing_metadata_is_named(tmp_path):
    path = checkpoint.save(_trained(), tmp_path / "c")
    (path / "meta.json").write_text('{"format": "engine.checkpoint", "format_')
    with pytest.raises(CheckpointError, match=r"meta\.json: not valid JSON"):
        checkpoint.load(path, _template())
    (path / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=r"meta\.json is missing"):
        checkpoint.load(path, _template())


def test_a_newer_format_version_is_refused(tmp_path):
    path = checkpoint.save(_trained(), tmp_path / "c")
    meta = json.loads((path / "meta.json").read_text())
    meta["format_version"] = checkpoint.FORMAT_VERSION + 1
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="newer than this engine reads"):
        checkpoint.load(path, _template())


class _Payload:
    """Unpickling this would create a file: the attack weights_only=True exists to stop."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_a_checkpoint_carrying_pickled_code_is_refused_and_nothing_runs(tmp_path):
    path = checkpoint.save(_trained(), tmp_path / "c")
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"params/0.weight": _Payload(str(marker))}, buf)
    (path / "tensors.pt").write_bytes(buf.getvalue())
    meta = json.loads((path / "meta.json").read_text())
    meta["files"]["tensors.pt"] = _chunked((path / "tensors.pt").read_bytes())  # a forger would
    meta["sizes"]["tensors.pt"] = len(buf.getvalue())
    _forge_meta(path, meta)
    with pytest.raises(CheckpointError, match="refused by the safe loader"):
        checkpoint.load(path, _template())
    assert not marker.exists()


def test_a_checkpoint_of_another_model_lists_what_does_not_fit(tmp_path):
    path = checkpoint.save(_trained(), tmp_path / "c")
    tx = optim.adamw(1e-2)
    other = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3), nn.Linear(3, 3))
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path, eg.TrainState.create(other, tx))
    msg = str(err.value)
    # saved: 0 Linear(4, 8), 1 BatchNorm(8), 3 Linear(8, 3); template: 0 Linear(4, 16),
    # 2 Linear(16, 3), 3 Linear(3, 3)
    assert "missing: ['2.bias', '2.weight']" in msg
    assert "unexpected: ['1.bias', '1.weight']" in msg
    assert "0.weight: checkpoint (8, 4) torch.float32, model (16, 4) torch.float32" in msg
    assert "3.weight: checkpoint (3, 8) torch.float32, model (3, 3) torch.float32" in msg


def test_a_full_disk_raises_clearly_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    first = _trained(calls=1)
    checkpoint.save(first, tmp_path / "c")

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(
        CheckpointError, match=r"disk is full .*the previous checkpoint at .* intact"
    ):
        checkpoint.save(_trained(calls=2), tmp_path / "c")
    monkeypatch.undo()
    assert checkpoint.load(tmp_path / "c", _template()).fingerprint() == first.fingerprint()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_leftovers_of_an_interrupted_save_are_cleaned_and_do_not_disturb(tmp_path):
    good = checkpoint.save(_trained(), tmp_path / "c")
    half = tmp_path / ".tmp-ckpt-abc123"  # what a crash between write and rename leaves
    half.mkdir()
    (half / "tensors.pt").write_bytes(b"\x00" * 10)
    assert checkpoint.clean_leftovers(tmp_path) == [half]
    assert not half.exists() and checkpoint.inspect(good)["verified"]


@pytest.mark.parametrize("new_one", ["complete", "damaged"])
def test_a_crash_between_the_renames_of_a_replacement_loses_no_checkpoint(tmp_path, new_one):
    # the process dies after moving the old checkpoint aside and before renaming the new one
    # into place: the next clean_leftovers puts the new one there if it verifies, else the old
    here = str(Path(__file__).parent)
    script = textwrap.dedent(f"""
        import os, sys; sys.path.insert(0, {here!r})
        from test_checkpoint import _trained
        from engine import checkpoint
        checkpoint.save(_trained(calls=2), {str(tmp_path / "c")!r})
        real, calls = os.replace, []
        def dying_replace(src, dst):
            calls.append(dst)
            if len(calls) == 2:  # the new checkpoint's rename into place
                os._exit(3)
            real(src, dst)
        os.replace = dying_replace
        checkpoint.save(_trained(calls=5), {str(tmp_path / "c")!r})
    """)
    done = _procs.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 3, done.stderr
    assert not (tmp_path / "c").exists()  # the crash left no checkpoint under the name
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-ckpt-old-")]
    assert len(aside) == 1 and (aside[0] / "c" / "meta.json").is_file()
    if new_one == "damaged":
        (new,) = [p for p in tmp_path.iterdir() if p.is_dir() and p not in aside]
        data = bytearray((new / "tensors.pt").read_bytes())
        data[len(data) // 2] ^= 1
        (new / "tensors.pt").write_bytes(bytes(data))
    checkpoint.clean_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    back = checkpoint.load(tmp_path / "c", _template())
    calls = 5 if new_one == "complete" else 2
    assert back.fingerprint() == _trained(calls=calls).fingerprint()


def test_leftovers_of_a_save_still_in_progress_are_left_alone(tmp_path):
    # a save holds a lock until it ends; the kernel drops it when its process dies, whatever the
    # process id (a container restarted with the same pid included)
    with _files._Claim(tmp_path) as claim:  # this process: a save in flight
        claim.path("").mkdir()
        assert checkpoint.clean_leftovers(tmp_path) == []
        claim.path("").rmdir()  # as the save would, renaming it into place
    other = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from engine.checkpoint import _files
        with _files._Claim(Path({str(tmp_path)!r})) as claim:
            claim.path("").mkdir()
            print(claim.id, flush=True)
            sys.stdin.readline()  # until told
    """)
    child = _procs.Popen(
        [sys.executable, "-c", other], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        claim_id = child.stdout.readline().strip()
        live = tmp_path / f".tmp-ckpt-{claim_id}"
        assert live.is_dir()
        assert checkpoint.clean_leftovers(tmp_path) == []  # another process's save in flight
    finally:
        child.kill()  # dies holding it
        child.wait()
    removed = checkpoint.clean_leftovers(tmp_path)
    assert {p.name for p in removed} == {live.name, f".tmp-ckpt-lock-{claim_id}"}
    assert list(tmp_path.iterdir()) == []


def test_an_error_between_the_renames_of_a_replacement_puts_the_old_checkpoint_back(
    tmp_path, monkeypatch
):
    checkpoint.save(_trained(calls=2), tmp_path / "c")
    real, calls = os.replace, []

    def failing_replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the new checkpoint's rename into place
            raise OSError(errno.EIO, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(CheckpointError, match=r"the previous checkpoint at .* is intact"):
        checkpoint.save(_trained(calls=5), tmp_path / "c")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert checkpoint.load(tmp_path / "c", _template()).fingerprint() == (
        _trained(calls=2).fingerprint()
    )


def test_engine_inspect_prints_the_summary_and_the_verdict(tmp_path):
    path = checkpoint.save(_trained(), tmp_path / "c", metrics={"val/acc": 0.75})
    cmd = [sys.executable, "-m", "engine", "inspect", str(path)]
    out = _procs.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "step            5" in out and "val/acc = 0.75" in out
    assert "checksums       all verify" in out
    info = json.loads(
        _procs.run([*cmd, "--json"], capture_output=True, text=True, check=True).stdout
    )
    assert info["num_params"] == _trained().num_params() and info["verified"]
    (path / "tensors.pt").write_bytes(b"garbage")
    bad = _procs.run(cmd, capture_output=True, text=True)
    assert bad.returncode == 1 and "FAILED" in bad.stdout


def test_an_asynchronous_save_holds_the_state_of_the_moment_it_was_asked_for(tmp_path):
    tx = optim.adamw(1e-2)
    step = eg.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]), tx)
    state = eg.TrainState.create(_model(), tx)
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(20)
    ]
    state, _ = step(state, batches[0])
    expected = state.fingerprint()
    future = checkpoint.save_async(state, tmp_path / "c")
    for b in batches[1:]:  # training goes on, updating the live tensors in place
        state, _ = step(state, b)
    assert future.result() == tmp_path / "c"
    back = checkpoint.load(tmp_path / "c", eg.TrainState.create(_model(), tx))
    assert back.fingerprint() == expected != state.fingerprint()


def test_an_asynchronous_save_that_fails_reports_through_its_future(tmp_path, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    future = checkpoint.save_async(_trained(calls=1), tmp_path / "c")
    with pytest.raises(CheckpointError, match="disk is full"):
        future.result()
    checkpoint.wait()


# ----------------------------------------------------------------- checksums, format version 3


def _big_state() -> eg.TrainState:  # 12.6 MB of tensors: two 8 MiB chunks
    torch.manual_seed(0)
    return eg.TrainState.create(nn.Linear(1024, 1024), optim.adamw(1e-3), seed=1)


def _forge_meta(path: Path, meta: dict) -> None:
    """Rewrite ``meta.json`` with ``meta`` and a matching checksum, as a forger would: the
    checksum computed here from docs/checkpoints.md's definition, not by the engine."""
    meta = {k: v for k, v in meta.items() if k != "meta_checksum"}
    head = json.dumps(meta, indent=2, sort_keys=True)[: -len("\n}")].encode()
    digest = xxhash.xxh3_128(head).hexdigest()
    (path / "meta.json").write_bytes(
        head + f',\n  "meta_checksum": "xxh3-128:{digest}"\n}}\n'.encode()
    )


def _chunked(data: bytes, chunk: int = 8 << 20, hash: str = "xxh3-128") -> str:
    """The checksum as docs/checkpoints.md defines it, computed here from that definition."""
    new = xxhash.xxh3_128 if hash == "xxh3-128" else hashlib.sha256
    digests = b"".join(new(data[i : i + chunk]).digest() for i in range(0, len(data), chunk))
    return f"{hash}-chunks-8MiB:" + new(digests).hexdigest()


def test_the_checksum_is_the_xxh3_128_of_the_xxh3_128s_of_8_mib_chunks(tmp_path):
    path = checkpoint.save(_big_state(), tmp_path / "c")
    data = (path / "tensors.pt").read_bytes()
    assert len(data) > 8 << 20
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format_version"] == 5
    assert meta["files"] == {"tensors.pt": _chunked(data)}
    assert meta["sizes"] == {"tensors.pt": len(data)}
    # a plain torch file, CRC-32s aside: torch.load reads it without the engine
    plain = torch.load(path / "tensors.pt", weights_only=True)
    assert torch.equal(plain["params/weight"], _big_state().params["weight"])


def test_a_format_2_checkpoint_with_chunked_sha256_still_loads_and_verifies(tmp_path):
    state = _big_state()
    path = checkpoint.save(state, tmp_path / "c")
    meta = json.loads((path / "meta.json").read_text())
    data = (path / "tensors.pt").read_bytes()
    meta["format_version"] = 2
    meta["files"]["tensors.pt"] = _chunked(data, hash="sha256")
    (path / "meta.json").write_text(json.dumps(meta))
    assert checkpoint.inspect(path)["verified"] is True
    assert checkpoint.load(path, _big_state()).fingerprint() == state.fingerprint()
    bad = bytearray(data)
    bad[len(bad) - 100] ^= 0x04
    (path / "tensors.pt").write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match=r"checksum check failed \(sha256-chunks-8MiB"):
        checkpoint.load(path, _big_state())


def test_the_writer_checksums_bytes_it_had_to_copy_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(_checksum, "np", None)  # no view of the tensors: every byte is copied
    monkeypatch.setattr(_checksum, "_MAX_COPIED", 1)  # and the writer waits for each chunk
    path = checkpoint.save(_big_state(), tmp_path / "c")
    data = (path / "tensors.pt").read_bytes()
    assert checkpoint.read_meta(path)["files"]["tensors.pt"] == _chunked(data)
    assert checkpoint.load(path, _big_state()).fingerprint() == _big_state().fingerprint()


@pytest.mark.parametrize("layout", ["mapped", "file"])
def test_a_bit_flip_anywhere_is_found_chunk_by_chunk(tmp_path, monkeypatch, layout):
    # 4 KiB chunks: every zip header, storage and boundary case falls in some chunk
    monkeypatch.setattr(_checksum, "_CHUNK", 4096)
    if layout == "file":  # hash pages of its own mapping, not those torch.load mapped
        monkeypatch.setattr(_read, "_layout", lambda *a: None)
    state = _trained(accumulate=3, calls=7)
    path = checkpoint.save(state, tmp_path / "c")
    f = path / "tensors.pt"
    good = f.read_bytes()
    assert checkpoint.read_meta(path)["files"]["tensors.pt"] == _chunked(good, 4096)
    assert checkpoint.load(path, _template()).fingerprint() == state.fingerprint()
    for at in (3, 100, len(good) // 3, len(good) // 2, len(good) - 30, len(good) - 1):
        bad = bytearray(good)
        bad[at] ^= 0x10
        f.write_bytes(bytes(bad))
        with pytest.raises(CheckpointError, match=r"tensors\.pt: checksum check failed"):
            checkpoint.load(path, _template())
    f.write_bytes(good[: len(good) - 4096])  # truncated at a chunk boundary
    with pytest.raises(CheckpointError, match=r"tensors\.pt: \d+ bytes, where meta"):
        checkpoint.load(path, _template())  # refused by its size first
    meta = json.loads((path / "meta.json").read_text())  # format 3: no size to refuse it by
    meta = {k: v for k, v in meta.items() if k not in ("sizes", "meta_checksum")}
    (path / "meta.json").write_text(json.dumps({**meta, "format_version": 3}))
    with pytest.raises(CheckpointError, match=r"tensors\.pt: checksum check failed"):
        checkpoint.load(path, _template())


def test_a_format_1_checkpoint_with_a_whole_file_sha256_still_loads(tmp_path):
    state = _trained()
    path = checkpoint.save(state, tmp_path / "c")
    meta = json.loads((path / "meta.json").read_text())
    meta["format_version"] = 1
    meta["files"]["tensors.pt"] = hashlib.sha256((path / "tensors.pt").read_bytes()).hexdigest()
    (path / "meta.json").write_text(json.dumps(meta))
    assert checkpoint.load(path, _template()).fingerprint() == state.fingerprint()
    data = bytearray((path / "tensors.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / "tensors.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensors\.pt: checksum check failed"):
        checkpoint.load(path, _template())


@pytest.mark.parametrize("checksum", ["md5:0123", None, 7])
def test_an_unknown_or_missing_checksum_is_refused(tmp_path, checksum):
    path = checkpoint.save(_trained(), tmp_path / "c")
    meta = json.loads((path / "meta.json").read_text())
    if checksum is None:
        del meta["files"]["tensors.pt"]
    else:
        meta["files"]["tensors.pt"] = checksum
    _forge_meta(path, meta)
    match = "unknown checksum scheme 'md5'" if checksum == "md5:0123" else "'files.*must be"
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load(path, _template())


def test_saving_leaves_torchs_zip_crc_option_as_it_was(tmp_path, monkeypatch):
    assert torch.serialization.get_crc32_options()
    checkpoint.save(_trained(), tmp_path / "a")
    assert torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        checkpoint.save(_trained(), tmp_path / "b")
        assert not torch.serialization.get_crc32_options()
    finally:
        torch.serialization.set_crc32_options(True)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(CheckpointError):
        checkpoint.save(_trained(), tmp_path / "c")
    assert torch.serialization.get_crc32_options()


def test_loads_and_saves_from_many_threads_at_once_all_finish(tmp_path):
    state = _big_state()
    path = checkpoint.save(state, tmp_path / "c")
    with ThreadPoolExecutor(6) as pool:
        loads = [pool.submit(checkpoint.load, path, _big_state()) for _ in range(4)]
        saves = [pool.submit(checkpoint.save, state, tmp_path / f"s{i}") for i in range(2)]
        later = checkpoint.save_async(state, tmp_path / "a")
        for f in loads:
            assert f.result(timeout=120).fingerprint() == state.fingerprint()
        for f in [*saves, later]:
            assert checkpoint.inspect(f.result(timeout=120))["verified"]


# ----------------------------------------------------------------- asynchronous saves' buffers


def _snapshot_pointers() -> dict[str, int]:
    idle = _snapshot._SNAPSHOTS._idle
    assert idle is not None
    return {k: t.data_ptr() for k, t in idle.tensors.items()}


def test_asynchronous_saves_reuse_their_buffers_until_the_shapes_change(tmp_path):
    checkpoint.release_buffers()
    first, second = _trained(calls=1), _trained(calls=2)
    checkpoint.save_async(first, tmp_path / "a").result()
    pointers = _snapshot_pointers()
    checkpoint.save_async(second, tmp_path / "b").result()
    assert _snapshot_pointers() == pointers  # copied into the same memory
    assert checkpoint.load(tmp_path / "a", _template()).fingerprint() == first.fingerprint()
    assert checkpoint.load(tmp_path / "b", _template()).fingerprint() == second.fingerprint()

    wider = eg.TrainState.create(_model(seed=1, width=16), optim.adamw(1e-2))
    checkpoint.save_async(wider, tmp_path / "w").result()  # other shapes: new buffers
    assert _snapshot._SNAPSHOTS._idle.tensors["params/0.weight"].shape == (16, 4)
    template = eg.TrainState.create(_model(seed=2, width=16), optim.adamw(1e-2))
    assert checkpoint.load(tmp_path / "w", template).fingerprint() == wider.fingerprint()
    checkpoint.release_buffers()
    assert _snapshot._SNAPSHOTS._idle is None


def test_saves_asked_for_while_an_asynchronous_one_is_in_flight_write_what_they_were_given(
    tmp_path, monkeypatch
):
    checkpoint.release_buffers()
    gate = threading.Event()
    written_from: list[set[int]] = []
    real_write = _save._write

    def held_write(tensors, meta, target):
        if threading.current_thread().name.startswith("engine-checkpoint"):
            written_from.append({t.data_ptr() for t in tensors.values()})
            gate.wait(60)  # the first write stays in flight until the saves below were asked for
        return real_write(tensors, meta, target)

    monkeypatch.setattr(_save, "_write", held_write)
    tx = optim.adamw(1e-2)
    step = eg.train_step(lambda m, b: F.cross_entropy(m(b[0]), b[1]), tx)
    state = eg.TrainState.create(_model(), tx)
    g = torch.Generator().manual_seed(0)
    expected = []
    futures = []
    for name in ("a", "b"):
        state, _ = step(
            state, (torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))
        )
        expected.append(state.fingerprint())
        futures.append(checkpoint.save_async(state, tmp_path / name))
    checkpoint.save(state, tmp_path / "sync")  # while the writer thread is held
    state, _ = step(state, (torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)))
    gate.set()
    assert [f.result(timeout=60) for f in futures] == [tmp_path / "a", tmp_path / "b"]
    assert len(written_from) == 2 and not written_from[0] & written_from[1]  # two buffer sets
    back = [checkpoint.load(tmp_path / n, _template_adamw()) for n in ("a", "b", "sync")]
    assert [b.fingerprint() for b in back] == [*expected, expected[1]]
    checkpoint.release_buffers()


def _template_adamw() -> eg.TrainState:
    return eg.TrainState.create(_model(seed=5), optim.adamw(1e-2))


def test_release_buffers_also_drops_those_of_a_save_in_flight(tmp_path, monkeypatch):
    gate = threading.Event()
    real_write = _save._write

    def held_write(tensors, meta, target):
        gate.wait(60)
        return real_write(tensors, meta, target)

    monkeypatch.setattr(_save, "_write", held_write)
    future = checkpoint.save_async(_trained(), tmp_path / "c")
    checkpoint.release_buffers()
    gate.set()
    future.result(timeout=60)
    assert _snapshot._SNAPSHOTS._idle is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_an_asynchronous_save_of_gpu_tensors_holds_the_moment_it_was_asked_for(tmp_path):
    tx = optim.adamw(1e-2)
    state = eg.TrainState.create(_model().cuda(), tx)
    expected = state.fingerprint()
    future = checkpoint.save_async(state, tmp_path / "c")
    for t in state.params.values():  # on the same stream: runs after the snapshot's copies
        t.detach().add_(1.0)
    future.result()
    template = eg.TrainState.create(_model(seed=9).cuda(), tx)
    back = checkpoint.load(tmp_path / "c", template)
    assert back.fingerprint() == expected
    assert all(t.is_cuda for t in back.params.values())


def test_the_states_extra_and_precision_trees_round_trip(tmp_path):
    import engine as eg
    from engine import optim

    model = torch.nn.Linear(3, 2)
    ema = {k: v.detach().clone() * 2 for k, v in model.named_parameters()}
    state = eg.TrainState.create(
        model, optim.sgd(0.1), extra={"ema": ema, "note": "run-7", "counts": (1, 2.5, None)}
    ).replace(precision={"scale": torch.tensor(65536.0), "growth": 3})
    back = checkpoint.load(
        checkpoint.save(state, tmp_path / "c"), eg.TrainState.create(model, optim.sgd(0.1))
    )
    assert back.extra["note"] == "run-7" and back.extra["counts"] == (1, 2.5, None)
    for k, v in ema.items():
        assert torch.equal(back.extra["ema"][k], v)
    assert back.precision["growth"] == 3 and torch.equal(
        back.precision["scale"], state.precision["scale"]
    )
    # the tensors went to tensors.pt, not into the JSON
    assert "ema" not in json.dumps(checkpoint.read_meta(tmp_path / "c")["metrics"])
    assert len(json.dumps(checkpoint.read_meta(tmp_path / "c")["trees"])) < 500
    assert back.fingerprint() == state.fingerprint()


def test_an_extra_value_that_needs_pickling_is_refused_at_save(tmp_path):
    import engine as eg
    from engine import optim

    state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1), extra={"fn": print})
    with pytest.raises(checkpoint.CheckpointError, match="extra/fn is a builtin_function"):
        checkpoint.save(state, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_a_weights_only_checkpoint_holds_the_model_and_says_so(tmp_path):
    state = _trained(accumulate=3, calls=7)  # an accumulation window half full
    path = checkpoint.save(state, tmp_path / "w", weights_only=True, fingerprint=True)
    stored = torch.load(path / "tensors.pt", weights_only=True)
    assert set(stored) == {f"params/{k}" for k in state.params} | {
        f"buffers/{k}" for k in state.buffers
    }
    meta = checkpoint.read_meta(path)
    assert meta["weights_only"] and meta["fingerprint"] is None  # it would not describe the file
    assert not meta["has_grad_accum"] and meta["step"] == state.step
    template = _template()
    back = checkpoint.load(path, template)
    assert all(torch.equal(back.params[k], state.params[k]) for k in state.params)
    assert back.opt_state is template.opt_state and back.grad_accum is None
    full = checkpoint.save(state, tmp_path / "f")
    assert (path / "tensors.pt").stat().st_size < (full / "tensors.pt").stat().st_size / 2
    out = _procs.run(
        [sys.executable, "-m", "engine", "inspect", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "weights only" in out and "all verify" in out


def test_save_with_its_arguments_swapped_says_so(tmp_path):
    state = _trained(calls=1)
    for save in (checkpoint.save, checkpoint.save_async):
        with pytest.raises(TypeError, match=r"TrainState first.*arguments swapped"):
            save(tmp_path / "c", state)
