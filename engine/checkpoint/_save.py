"""Writing a checkpoint (private): :func:`save` atomically and durably, :func:`save_async` from a
host snapshot on the writer thread, :func:`wait` and :func:`release_buffers`."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from engine.checkpoint import _layouts, _meta
from engine.checkpoint._checksum import _WRITER, _HashingWriter, _NoZipCrc
from engine.checkpoint._files import (
    META,
    TENSORS,
    _Claim,
    _describe,
    _flatten,
    _fsync_dir,
    _publish,
    _replaceable,
    _write_failed,
)
from engine.checkpoint._snapshot import _SNAPSHOTS, _Snapshot
from engine.errors import CheckpointError
from engine.state import TrainState

__all__ = ["release_buffers", "save", "save_async", "wait"]


def _write(tensors: Mapping[str, Tensor], meta: Mapping[str, Any], target: Path) -> Path:
    """Write a checkpoint directory atomically and durably (see :func:`save`)."""
    _replaceable(target)
    existed = (target / META).is_file()
    with contextlib.ExitStack() as held:
        try:
            claim = held.enter_context(_Claim(target.parent))
        except OSError as e:  # no room for even its lock file
            raise _write_failed(target, e, "", existed) from e
        tmp = claim.path("")
        writer, writing = None, TENSORS
        try:
            tmp.mkdir()
            with open(tmp / TENSORS, "wb") as raw:
                writer = _HashingWriter(raw, tensors.values())  # hashes in parallel: no re-read
                with _NoZipCrc() as no_crc:
                    writer.on_first_write = no_crc.restore
                    torch.save(dict(tensors), writer)  # type: ignore[arg-type]  # a binary file
                raw.flush()
                os.fsync(raw.fileno())  # the last chunks hash meanwhile
                checksum = writer.checksum()
                size = os.fstat(raw.fileno()).st_size
            writing = META
            with open(
                tmp / META, "wb"
            ) as out:  # with its own checksum (engine/checkpoint/_meta.py)
                out.write(
                    _meta.encode({**meta, "files": {TENSORS: checksum}, "sizes": {TENSORS: size}})
                )
                out.flush()
                os.fsync(out.fileno())
            _fsync_dir(tmp)
            writing = ""
            _publish(claim, tmp, target)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            # torch.save reports a failed write as a RuntimeError of its own ("[enforce fail at
            # inline_container.cc] ... unexpected pos"): the OSError behind it says what failed
            cause = writer.error if isinstance(e, RuntimeError) and writer is not None else None
            if isinstance(e, OSError):
                cause = e
            if cause is not None:
                raise _write_failed(target, cause, writing, existed) from cause
            raise
    return target


def save(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    metrics: Mapping[str, float] | None = None,
    extra: Mapping[str, Any] | None = None,
    fingerprint: bool = False,
    weights_only: bool = False,
    rank_grad_accum: Sequence[Mapping[str, Tensor]] = (),
) -> Path:
    """Write ``state`` to the checkpoint directory ``path`` atomically and durably.

    Args:
        state: the state to save (read, not consumed).
        path: the checkpoint directory to create; an existing one is replaced atomically.
        metrics: host-side metrics to record in ``meta.json`` (floats).
        extra: JSON-serialisable data to record (listener states, data position, config).
        fingerprint: also record ``state.fingerprint()`` in ``meta.json`` (a second pass over
            every byte, as costly as the write itself).
        weights_only: save the model alone (parameters and buffers, with the counters), as
            Lightning's ``save_weights_only``: a smaller file that ``validate`` / ``test`` /
            ``predict`` and :meth:`TrainState.load_into` can use but a fit cannot resume from.
        rank_grad_accum: a data-parallel run saved inside an accumulation window: the partial
            gradient sums of ranks 1, 2, ... (``state.grad_accum`` is rank 0's), each rank's
            own micro-batches summed before the step's all-reduce. ``load(path, template,
            rank=r)`` gives rank ``r`` its own, so every rank continues its window bitwise.

    A sharded state (any DTensor, ``strategy="fsdp"``) is saved by every rank of the process
    group together: call ``save`` on every rank with the same ``path`` (a collective). Each
    rank writes its own shards through ``torch.distributed.checkpoint`` into one temporary
    directory, and rank 0 writes ``meta.json`` (its ``metrics`` and ``extra``) last and renames
    the whole into place; a failure on any rank fails the save on every rank, and a rank killed
    meanwhile leaves nothing under ``path`` (see docs/checkpoints.md, "Sharded checkpoints").
    ``fingerprint=True`` records the fingerprint of the full (gathered) values.

    Returns:
        The checkpoint's path.

    Raises:
        CheckpointError: when writing fails (a full disk, say); the previous checkpoint at
            ``path``, if any, is left untouched and the temporary files are removed. Also when
            ``path`` exists and is not a checkpoint (a file, or a directory with files but no
            ``meta.json``): a save never deletes what it did not write.

    Example:
        >>> import tempfile, torch
        >>> import engine as eg
        >>> from engine import checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.adam(1e-3), seed=7)
        >>> with tempfile.TemporaryDirectory() as d:
        ...     path = checkpoint.save(state, f"{d}/step=0")
        ...     back = checkpoint.load(path, state)
        ...     back.fingerprint() == state.fingerprint()
        True
    """
    _is_state(state, path, "save")
    state.check_alive("checkpoint.save()")
    layout = _layouts.of_state(state)
    if layout is not None:  # a strategy's (a sharded state: a collective, every rank's shards)
        return layout.save(
            state,
            Path(path),
            metrics=metrics,
            extra=extra,
            fingerprint=fingerprint,
            weights_only=weights_only,
            rank_grad_accum=rank_grad_accum,
        )
    _replaceable(Path(path))
    tensors, scalars = _flatten(state, weights_only, rank_grad_accum)
    meta = _describe(state, scalars, metrics, extra, fingerprint, weights_only)
    meta["grad_accum_ranks"] = _ranks_held(state, weights_only, rank_grad_accum)
    return _write(tensors, meta, Path(path))


def _ranks_held(
    state: TrainState, weights_only: bool, rank_grad_accum: Sequence[Mapping[str, Tensor]]
) -> int:
    """How many ranks' partial gradient sums a checkpoint holds (0: none, at a step)."""
    if weights_only or state.grad_accum is None:
        return 0
    return 1 + len(rank_grad_accum)


def _write_snapshot(
    snapshot: _Snapshot, meta: dict[str, Any], target: Path, view: TrainState | None
) -> Path:
    # Let save_async return first: it is about to, holding the GIL, and this thread, woken by
    # the submission, would otherwise take the GIL from it for a switch interval (5 ms).
    time.sleep(0.001)
    try:
        snapshot.ready()
        if view is not None:  # the snapshot holds the saved bits: hash them here, off the loop
            meta["fingerprint"] = view.fingerprint()
        return _write(snapshot.tensors, meta, target)
    finally:
        _SNAPSHOTS.give_back(snapshot)


def _snapshot_view(state: TrainState, snapshot: _Snapshot) -> TrainState:
    """``state`` with every tensor its fingerprint covers read from ``snapshot`` (host copies:
    for hashing only, nothing is moved back to a device)."""
    copies = snapshot.tensors
    leaves, spec = pytree.tree_flatten_with_path(state.opt_state)
    opt = [copies.get(f"opt_state/{pytree.keystr(path)}", leaf) for path, leaf in leaves]
    return state.replace(
        params={k: copies[f"params/{k}"] for k in state.params},
        buffers={k: copies[f"buffers/{k}"] for k in state.buffers},
        grad_accum=None
        if state.grad_accum is None
        else {k: copies[f"grad_accum/{k}"] for k in state.grad_accum},
        opt_state=pytree.tree_unflatten(opt, spec),
        _ownership=type(state._ownership)(),
    )


def _is_state(state: Any, path: Any, fn: str) -> None:
    if not isinstance(state, TrainState):
        swapped = " (the arguments swapped?)" if isinstance(path, TrainState) else ""
        raise TypeError(
            f"checkpoint.{fn}(state, path) takes the TrainState first (got a "
            f"{type(state).__name__}){swapped}; checkpoint.load(path, template) is the other way"
        )


def save_async(
    state: TrainState,
    path: str | os.PathLike[str],
    *,
    metrics: Mapping[str, float] | None = None,
    extra: Mapping[str, Any] | None = None,
    fingerprint: bool = False,
    weights_only: bool = False,
    rank_grad_accum: Sequence[Mapping[str, Tensor]] = (),
) -> Future[Path]:
    """Snapshot ``state`` now and write it to ``path`` in the background.

    Only the snapshot (a copy of every tensor into host memory kept from the previous
    asynchronous save, see :func:`release_buffers`) blocks the caller; serialising, hashing and
    the fsyncs happen on one writer thread, so saves complete in the order they were asked for.
    Training may go on donating the live state's tensors meanwhile (on a GPU: on the stream that
    was current at the call, so that it runs after the copies). The returned future gives the
    path, or raises what :func:`save` would have; :func:`wait` waits for all of them.
    ``fingerprint=True`` records ``state.fingerprint()`` in ``meta.json`` as :func:`save` does,
    hashed from the snapshot on the writer thread, so it does not block the caller either;
    ``weights_only`` and ``rank_grad_accum`` are :func:`save`'s.

    A sharded state (DTensors: ``strategy="fsdp"``) is saved by every rank together, as by
    :func:`save` (a collective: call it on every rank, in the same order as the other
    saves): the ranks' agreement, the fingerprint (a gather) and a copy of this rank's shards
    happen in the call; ``torch.distributed.checkpoint``'s write, the checksums, ``meta.json``
    and the rename on the writer thread, whose collectives run on a gloo process group of the
    checkpoints' own (made by the first such save), so they never interleave with the
    training's.

    Example:
        >>> import tempfile, torch
        >>> import engine as eg
        >>> from engine import checkpoint, optim
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     future = checkpoint.save_async(state, f"{d}/c")
        ...     checkpoint.read_meta(future.result())["step"]
        0
    """
    _is_state(state, path, "save_async")
    state.check_alive("checkpoint.save_async()")
    try:
        layout = _layouts.of_state(state)
        if layout is not None:  # a strategy's (a sharded state: every rank writes its shards)
            return layout.save_async(
                state,
                Path(path),
                metrics=metrics,
                extra=extra,
                fingerprint=fingerprint,
                weights_only=weights_only,
                rank_grad_accum=rank_grad_accum,
            )
    except CheckpointError as e:
        failed_now: Future[Path] = Future()
        failed_now.set_exception(e)
        return failed_now
    tensors, scalars = _flatten(state, weights_only, rank_grad_accum)
    try:
        _replaceable(Path(path))  # here, so that the caller hears of it at once
        meta = _describe(state, scalars, metrics, extra, False, weights_only)
        meta["grad_accum_ranks"] = _ranks_held(state, weights_only, rank_grad_accum)
    except CheckpointError as e:
        failed: Future[Path] = Future()
        failed.set_exception(e)
        return failed
    snapshot = _SNAPSHOTS.take(tensors)
    try:
        view = _snapshot_view(state, snapshot) if fingerprint and not weights_only else None
        future = _WRITER.get().submit(_write_snapshot, snapshot, meta, Path(path), view)
        future.add_done_callback(partial(_give_back_if_cancelled, snapshot))
        return future
    except BaseException:
        _SNAPSHOTS.give_back(snapshot)
        raise


def _give_back_if_cancelled(snapshot: _Snapshot, future: Future[Path]) -> None:
    if future.cancelled():  # it never ran, so _write_snapshot did not return the buffers
        _SNAPSHOTS.give_back(snapshot)


def wait() -> None:
    """Block until every asynchronous save has finished (errors surface through the futures)."""
    writer = _WRITER.started()
    if writer is not None:
        writer.submit(lambda: None).result()


def release_buffers() -> None:
    """Free the host copy of the state that :func:`save_async` keeps for the next save.

    Asynchronous saves keep the buffers their last snapshot used (one state's worth of host
    memory) so that the next snapshot only copies; this drops them, and those of pending saves
    once they end. The next asynchronous save allocates afresh.
    """
    _SNAPSHOTS.release()
