"""Sharded (FSDP) checkpoints under faults not tried before (issue 24, item 7): a full disk under
synchronous and asynchronous saves on 2 ranks (a real tmpfs where ``mount`` is allowed, injected
``ENOSPC`` everywhere), SIGKILL of one rank during an asynchronous save of a fit, and a
``bf16-mixed`` FSDP checkpoint resumed on 2 ranks and on 1 process.

What each promises: the error says the disk is full on every rank; the previous checkpoint is
intact and loads; nothing is left under a checkpoint's name, and
:func:`engine.checkpoint.clean_leftovers` removes what a killed rank left; the other rank ends
(an error, never a hang: each run has a deadline); a resume is bitwise where the docs say so.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import run_ranks
from test_checkpoint_sharded import _bitwise, _full_state, _init, _plain, _shard

import engine as eg
from engine import checkpoint
from engine.errors import CheckpointError

pytestmark = pytest.mark.slow  # 2 spawned ranks each

TIMEOUT = 90.0
FULL = "the disk is full"


def _big(mesh, seed: int = 2) -> eg.TrainState:
    """A sharded state of ~3 MB (more than the tiny disk holds)."""
    from engine import optim

    torch.manual_seed(seed)
    state = eg.TrainState.create(torch.nn.Linear(512, 512), optim.adam(1e-2), seed=seed)
    return _shard(state, mesh)


def _listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# --------------------------------------------------------------------------- a full disk


def _save_big(mesh, disk) -> dict:
    """A big state saved at c (a replacement) and at d (a new name), synchronously and in the
    background: what this rank heard of each save."""
    said = {}
    for mode in ("sync", "async"):
        for name in ("c", "d"):
            try:
                if mode == "sync":
                    checkpoint.save(_big(mesh), f"{disk}/{name}")
                else:
                    checkpoint.save_async(_big(mesh), f"{disk}/{name}").result(TIMEOUT)
                said[mode, name] = "saved"
            except CheckpointError as e:
                said[mode, name] = str(e)
    return said


def _fill_the_disk(rank: int, disk: str) -> dict:
    """Save a small state at c; then a big one at c (a replacement) and at d (a new name),
    synchronously and in the background: what each rank heard."""
    mesh = _init()
    checkpoint.save(_shard(_full_state(), mesh), f"{disk}/c")
    return _save_big(mesh, disk)


def _assert_full_everywhere(results: list[dict], disk: Path) -> None:
    for rank, said in enumerate(results):
        for (mode, name), message in said.items():
            assert FULL in message, (rank, mode, name, message)
            assert f"could not write checkpoint {disk / name}" in message
            assert "Traceback" not in message  # one line, not DCP's nested traceback
            if name == "c":
                assert f"the previous checkpoint at {disk / 'c'} is intact" in message
            assert f"Free space on the file system of {disk}" in message
    assert _listing(disk) == ["c"]  # no temporary directory, no lock, nothing named d
    checkpoint.verify(disk / "c")
    _bitwise(_plain(checkpoint.load(disk / "c", _full_state(seed=5))), _plain(_full_state()))


def test_a_real_full_disk_fails_sync_and_async_sharded_saves_on_every_rank(tiny_disk):
    results = run_ranks(_fill_the_disk, 2, str(tiny_disk), timeout=TIMEOUT)
    _assert_full_everywhere(results, tiny_disk)


def _injected(rank: int, disk: str, where: str) -> dict:
    """As :func:`_fill_the_disk`, with the disk filled by injection: ``where="shards"``: rank
    1's shard file takes no byte (ENOSPC on its first write, as ``write(2)``); ``"meta"``:
    rank 0's ``meta.json`` cannot be written."""
    from torch.distributed.checkpoint import filesystem

    from engine.parallel import _dcp

    mesh = _init()
    checkpoint.save(_shard(_full_state(), mesh), f"{disk}/c")
    if where == "shards" and rank == 1:
        opened = filesystem.FileSystem.create_stream

        class Full:
            def __init__(self, stream):
                self.stream = stream

            def write(self, data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            def __getattr__(self, name):
                return getattr(self.stream, name)

        import contextlib

        @contextlib.contextmanager
        def full(self, path, mode):
            with opened(self, path, mode) as stream:
                yield Full(stream) if str(path).endswith(".distcp") else stream

        filesystem.FileSystem.create_stream = full
    if where == "meta" and rank == 0:

        def full_open(file, mode="r", *args, **kwargs):
            if str(file).endswith("meta.json") and "w" in mode:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
            return open(file, mode, *args, **kwargs)

        _dcp.open = full_open  # type: ignore[attr-defined]  # the module's own open
    return _save_big(mesh, disk)


@pytest.mark.parametrize("where", ["shards", "meta"])
def test_an_injected_full_disk_fails_sync_and_async_sharded_saves_on_every_rank(tmp_path, where):
    disk = tmp_path / "disk"
    disk.mkdir()
    results = run_ranks(_injected, 2, str(disk), where, timeout=TIMEOUT)
    _assert_full_everywhere(results, disk)
    for said in results:  # which file the disk filled at, on every rank
        for message in said.values():
            assert ("rank 1's shards" if where == "shards" else "meta.json") in message


# --------------------------------------------------------------------------- SIGKILL, async


def _tiny_fit(root: str, **flags):
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from engine import optim

    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g))
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.adamw(1e-2))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    trainer = eg.Trainer(
        max_epochs=2,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **flags,
    )
    return trainer, task, task.init(model, seed=0), DataLoader(ds, batch_size=4)


def _killed_in_the_background(rank: int, root: str, victim: int, at: int, report: str) -> None:
    """An FSDP fit saving every 2 steps in the background; once step ``at`` is done, rank
    ``victim`` waits for its saves so far, then is SIGKILLed in its next shard write (of the
    next save, in flight while both train). The other rank records how its fit ended, and how
    long after the kill it took."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem._write_item

    def dying(*args, **kwargs):
        out = original(*args, **kwargs)
        args[1].flush()
        Path(report + ".killed").write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
        return out

    class Arm(eg.Listener):
        def on_train_batch_end(self, rec):
            if rec.state.step == at and rank == victim:
                checkpoint.wait()  # the saves before are complete: the kill hits a later one
                filesystem._write_item = dying

    mc = eg.ModelCheckpoint(
        dirpath=f"{root}/ckpts", every_n_train_steps=2, save_top_k=-1, asynchronous=True
    )
    trainer, task, state, loader = _tiny_fit(
        root, strategy="fsdp", devices=2, callbacks=[Arm(), mc]
    )
    try:
        trainer.fit(task, state, loader)
        said = "fitted"
    except BaseException as e:
        said = f"{type(e).__name__}: {e}"
    Path(report).write_text(f"{time.time()}\n{said}")
    os._exit(0)  # the process group cannot be torn down with a dead peer


@pytest.mark.parametrize(("victim", "at"), [(1, 3), (0, 15)])
def test_sigkill_of_a_rank_during_an_asynchronous_fsdp_save_ends_the_other(tmp_path, victim, at):
    """Rank 1 killed mid-run (rank 0 owns the save's temporary directory and removes it), or
    rank 0 killed at the run's last saves (its temporary directory and lock are left for
    clean_leftovers)."""
    report = tmp_path / "report"
    with pytest.raises(RuntimeError, match=rf"rank\(s\) \[{victim}\] died"):
        run_ranks(
            _killed_in_the_background, 2, str(tmp_path), victim, at, str(report), timeout=TIMEOUT
        )
    ended, said = report.read_text().split("\n", 1)  # the survivor did not hang
    killed = float(Path(f"{report}.killed").read_text())
    assert float(ended) - killed < 30, "the survivor took too long to end"
    assert said != "fitted" and ("Error" in said.split(":")[0]), said
    ckpts = tmp_path / "ckpts"
    checkpoint.clean_leftovers(ckpts)
    names = _listing(ckpts)
    assert not [n for n in names if n.startswith(".tmp-ckpt")], names
    saved = [n for n in names if not n.startswith(".")]
    assert saved and all(n.startswith("epoch=") for n in saved), names
    for name in saved:  # nothing half-written under a checkpoint's name
        checkpoint.verify(ckpts / name)
    latest = max(saved, key=lambda n: int(n.split("step=")[1]))
    _, _, template, _ = _tiny_fit(str(tmp_path / "load"))
    back = checkpoint.load(ckpts / latest, template)  # on one process, without a group
    assert back.step == int(latest.split("step=")[1])


# --------------------------------------------------------------------------- bf16-mixed resume


def _params_and_moments(state: eg.TrainState) -> dict:
    from engine import optim
    from engine.parallel import full_state

    whole = full_state(state)
    out = {f"params/{k}": v.detach().clone() for k, v in whole.params.items()}
    for k, v in optim.base.state_dict(whole.opt_state).items():
        out[f"opt_state/{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    out["step"] = whole.step
    return out


def _bf16_fits(rank: int, root: str) -> dict:
    """An FSDP bf16-mixed fit of 2 epochs, checkpointed each epoch; then the same fit resumed
    on these 2 ranks from its first epoch's checkpoint."""
    ran = {}
    for name, ckpt in (("whole", None), ("resumed", f"{root}/whole/ckpts/epoch=0-step=6")):
        mc = eg.ModelCheckpoint(dirpath=f"{root}/{name}/ckpts", save_top_k=-1)
        trainer, task, state, loader = _bf16_fit(
            f"{root}/{name}", 4, strategy="fsdp", devices=2, callbacks=[mc]
        )
        ran[name] = _params_and_moments(trainer.fit(task, state, loader, ckpt_path=ckpt))
    return ran


def _bf16_fit(root: str, batch: int, **flags):
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from engine import optim

    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(48, 6, generator=g), torch.randn(48, 3, generator=g))
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.adamw(1e-2, weight_decay=0.01))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    trainer = eg.Trainer(
        precision="bf16-mixed",
        max_epochs=2,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **flags,
    )
    loader = DataLoader(ds, batch_size=batch, shuffle=True)
    return trainer, task, task.init(model, seed=0), loader


def _same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_a_bf16_mixed_fsdp_checkpoint_resumes_bitwise_on_two_ranks_and_on_one_process(tmp_path):
    import warnings

    ran = run_ranks(_bf16_fits, 2, str(tmp_path), timeout=TIMEOUT)[0]
    # on the same 2 ranks: the run that never stopped, bitwise (docs/precision.md, "Resuming")
    _same(ran["resumed"], ran["whole"])
    assert ran["whole"]["step"] == 12
    # on 1 process (strategy="auto", the global batch of 2 ranks' 4): the sharded checkpoint
    # loads bitwise (docs/distributed.md: "a 2-rank checkpoint on 1 process ... bitwise in the
    # parameters and the optimizer state"), so the fit resumed from it is bitwise the fit
    # resumed from a full checkpoint of the same values and loop state
    sharded = tmp_path / "whole" / "ckpts" / "epoch=0-step=6"
    meta = checkpoint.read_meta(sharded)
    assert meta["layout"] == "sharded" and meta["world_size"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ModelCheckpoint's dirpath is another one: said so
        trainer, task, state, loader = _bf16_fit(str(tmp_path / "one"), 8)
        one = _params_and_moments(trainer.fit(task, state, loader, ckpt_path=str(sharded)))
        trainer, task, state, loader = _bf16_fit(str(tmp_path / "full"), 8)
        full = checkpoint.save(
            checkpoint.load(sharded, state),
            tmp_path / "full-ckpt",
            extra=meta.get("extra"),
            metrics=meta.get("metrics"),
        )
        assert checkpoint.read_meta(full).get("layout") != "sharded"
        from_full = _params_and_moments(trainer.fit(task, state, loader, ckpt_path=str(full)))
    _same(one, from_full)
    assert one["step"] == 12
    # and it trains as the 2 ranks did, to bfloat16's precision: FSDP gathers the weights in
    # bfloat16, one process reads them in float32 (docs/distributed.md, "Precision")
    for k, v in ran["whole"].items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            assert (one[k] - v).abs().max().item() < 5e-3, k
