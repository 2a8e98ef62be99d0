"""Sharded checkpoints (issue 18): a TrainState of DTensors saved by 2 gloo ranks through
torch.distributed.checkpoint, loaded on 2 ranks, on 1 process without a process group (the
gathered values) and from a full checkpoint onto 2 ranks, each bitwise; verified file by file;
atomic under SIGKILL of either rank; its fingerprint that of the same values unsharded.

The reference values are built the same way on every process (seeded), unsharded; the sharded
state is that state with each parameter-shaped tensor ``distribute_tensor``-ed ``Shard(0)`` (a
0-dim one replicated), as engine/parallel/fsdp.py's contract says (docs: contract 18).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import _procs
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ranks import run_ranks

import engine as eg
from engine import checkpoint, optim
from engine.checkpoint import _meta
from engine.checkpoint._checksum import _checksum
from engine.errors import CheckpointError

pytestmark = pytest.mark.slow  # 2 spawned ranks each

TIMEOUT = 60.0


def _full_state(seed: int = 0) -> eg.TrainState:
    """A 'trained' unsharded state: parameters of uneven first dims (5 and 1 over 2 ranks), a
    0-dim parameter, an optimizer state and accumulated gradients of random bits, a buffer."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    model.register_buffer("count", torch.arange(4.0))
    model.register_parameter("scale", torch.nn.Parameter(torch.tensor(0.5)))
    state = eg.TrainState.create(model, optim.adamw(1e-2, weight_decay=0.01), seed=3)
    g = torch.Generator().manual_seed(seed + 1)
    leaves, spec = torch.utils._pytree.tree_flatten(state.opt_state)
    leaves = [
        torch.randn(x.shape, generator=g).to(x.dtype)
        if isinstance(x, torch.Tensor) and x.is_floating_point()
        else x
        for x in leaves
    ]
    return state.replace(
        params={
            k: torch.randn(v.shape, generator=g).requires_grad_() for k, v in state.params.items()
        },
        opt_state=torch.utils._pytree.tree_unflatten(leaves, spec),
        grad_accum={k: torch.randn(v.shape, generator=g) for k, v in state.params.items()},
        step=7,
        epoch=1,
        batch_idx=2,
        micro_step=1,
        extra={"note": "x", "t": torch.tensor([1.0, 2.0])},
    )


def _shard(state: eg.TrainState, mesh) -> eg.TrainState:
    """``state`` sharded as contract 18 says (every rank holds the same full values)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    shapes = {tuple(p.shape) for p in state.params.values()}

    def place(t: torch.Tensor) -> torch.Tensor:
        placement = [Shard(0)] if t.dim() else [Replicate()]
        return distribute_tensor(t.detach(), mesh, placement, src_data_rank=None)

    def leaf(x):
        if isinstance(x, torch.Tensor) and x.dim() and tuple(x.shape) in shapes:
            return place(x)
        return x

    return state.replace(
        params={k: place(v).requires_grad_(v.requires_grad) for k, v in state.params.items()},
        opt_state=torch.utils._pytree.tree_map(leaf, state.opt_state),
        grad_accum={k: place(v) for k, v in state.grad_accum.items()}
        if state.grad_accum is not None
        else None,
    )


def _plain(state: eg.TrainState) -> dict[str, torch.Tensor]:
    """Every tensor of the state (full values; a collective for a sharded state), by key."""
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach()

    out = {f"params/{k}": full(v) for k, v in state.params.items()}
    out.update((f"buffers/{k}", full(v)) for k, v in state.buffers.items())
    out.update((f"grad_accum/{k}", full(v)) for k, v in (state.grad_accum or {}).items())
    for k, v in optim.base.state_dict(state.opt_state).items():
        out[f"opt_state/{k}"] = full(v) if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k


def _init(world: int = 2):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    return init_device_mesh("cpu", (world,))


# --------------------------------------------------------------------------- rank functions


def _save_and_reload(rank: int, path: str) -> dict:
    """Save the sharded state, load it back into a sharded template of other values."""
    from torch.distributed.tensor import DTensor

    mesh = _init()
    state = _shard(_full_state(), mesh)
    fp = state.fingerprint()
    copied = state.copy()
    out = checkpoint.save(state, path, fingerprint=True, metrics={"loss": 0.25})
    template = _shard(_full_state(seed=5), mesh)
    back = checkpoint.load(out, template)
    assert isinstance(back.params["0.weight"], DTensor)
    assert back.params["0.weight"].requires_grad
    local = {k: v.to_local() for k, v in back.params.items()}
    mine = {k: v.to_local() for k, v in state.params.items()}
    _bitwise(local, mine)
    assert (back.step, back.epoch, back.batch_idx, back.micro_step, back.seed) == (7, 1, 2, 1, 3)
    return {
        "fp": fp,
        "copy_fp": copied.fingerprint(),
        "back_fp": back.fingerprint(),
        "full": _plain(back),
        "extra": back.extra["note"],
    }


def test_sharded_save_reloads_bitwise_on_two_ranks_and_fingerprints_as_unsharded(tmp_path):
    path = tmp_path / "c"
    results = run_ranks(_save_and_reload, 2, str(path), timeout=TIMEOUT)
    reference = _full_state()
    want = reference.fingerprint()
    for r in results:  # the sharded state's fingerprint is the unsharded one's, on every rank
        assert r["fp"] == r["copy_fp"] == r["back_fp"] == want
        _bitwise(r["full"], _plain(reference))
        assert r["extra"] == "x"
    meta = checkpoint.read_meta(path)
    assert meta["layout"] == "sharded" and meta["world_size"] == 2
    assert meta["format_version"] == _meta.SHARDED_FORMAT_VERSION
    assert meta["fingerprint"] == want and meta["metrics"] == {"loss": 0.25}
    assert meta["tensors"]["params/0.weight"] == {
        "shape": [5, 3],
        "dtype": "float32",
        "placements": ["Shard(dim=0)"],
    }
    assert meta["tensors"]["buffers/count"]["placements"] is None
    assert sorted(meta["files"]) == [
        "shards/.metadata",
        "shards/__0_0.distcp",
        "shards/__1_0.distcp",
    ]
    assert sorted(os.listdir(path)) == ["meta.json", "shards"]
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no temporary directory, no lock left


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "c"
    run_ranks(_save_only, 2, str(path), timeout=TIMEOUT)
    return path


def _save_only(rank: int, path: str) -> None:
    mesh = _init()
    checkpoint.save(_shard(_full_state(), mesh), path, fingerprint=True)
    checkpoint.save(_shard(_full_state(), mesh), f"{path}-weights", weights_only=True)
    try:
        checkpoint.save(_shard(_full_state(), mesh), f"{path}-{rank}")
    except CheckpointError as e:
        assert "the ranks name different paths" in str(e)
    else:
        raise AssertionError("a save to a path of each rank's own was not refused")


def test_two_ranks_to_one_process_without_a_process_group_gathers_bitwise(tmp_path):
    import torch.distributed as dist

    path = _saved(tmp_path)
    assert not dist.is_initialized()
    reference = _full_state()
    back = checkpoint.load(path, _full_state(seed=9))
    _bitwise(_plain(back), _plain(reference))
    assert (
        back.fingerprint() == reference.fingerprint() == checkpoint.read_meta(path)["fingerprint"]
    )
    assert torch.equal(back.extra["t"], torch.tensor([1.0, 2.0]))
    assert all(type(t) is torch.Tensor for t in back.params.values())
    # the weights alone, into a plain module; and one exported full file
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    model.register_buffer("count", torch.zeros(4))
    model.register_parameter("scale", torch.nn.Parameter(torch.tensor(0.0)))
    assert checkpoint.load_weights(path, model) == checkpoint.IncompatibleKeys([], [])
    for k, v in model.state_dict().items():
        key = f"buffers/{k}" if k == "count" else f"params/{k}"
        assert torch.equal(v, _plain(reference)[key]), k
    weights = checkpoint.read_meta(f"{path}-weights")
    assert weights["weights_only"] and not any(k.startswith("opt_") for k in weights["tensors"])
    out = checkpoint.export(f"{path}-weights", tmp_path / "model.pt")
    plain = torch.load(out, weights_only=True)
    assert set(plain) == set(model.state_dict())
    for k, v in plain.items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_inspect_and_the_cli_read_a_sharded_checkpoint(tmp_path):
    path = _saved(tmp_path)
    info = checkpoint.inspect(path)
    assert info["layout"] == "sharded" and info["world_size"] == 2 and info["verified"]
    assert info["tensors"]["params/0.weight"]["shape"] == [5, 3]
    assert info["step"] == 7 and info["size_bytes"] > 0
    done = _procs.run(
        [sys.executable, "-m", "engine", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    assert "sharded over 2 ranks" in done.stdout and "all verify" in done.stdout
    assert "0.weight" in done.stdout and "5x3" in done.stdout


def _load_full(rank: int, path: str) -> dict:
    from torch.distributed.tensor import DTensor

    mesh = _init()
    template = _shard(_full_state(seed=4), mesh)
    back = checkpoint.load(path, template)
    placed = {k: (type(v).__name__, tuple(v.to_local().shape)) for k, v in back.params.items()}
    assert isinstance(back.grad_accum["0.weight"], DTensor)
    state = optim.base.state_dict(back.opt_state)
    kinds = {k: type(v).__name__ for k, v in state.items() if isinstance(v, torch.Tensor)}
    return {"placed": placed, "kinds": kinds, "full": _plain(back), "fp": back.fingerprint()}


def test_a_full_checkpoint_loads_onto_two_ranks_sharded_like_the_template(tmp_path):
    reference = _full_state()
    path = checkpoint.save(reference, tmp_path / "full")
    r0, r1 = run_ranks(_load_full, 2, str(path), timeout=TIMEOUT)
    for r in (r0, r1):
        _bitwise(r["full"], _plain(reference))
        assert r["fp"] == reference.fingerprint()
        assert r["kinds"]["[0].exp_avg['0.weight']"] == "DTensor"
    # torch.chunk's split of 5 rows over 2 ranks: 3 and 2; of 1 row: 1 and 0
    assert r0["placed"]["0.weight"] == ("DTensor", (3, 3))
    assert r1["placed"]["0.weight"] == ("DTensor", (2, 3))
    assert (r0["placed"]["2.weight"], r1["placed"]["2.weight"]) == (
        ("DTensor", (1, 5)),
        ("DTensor", (0, 5)),
    )


def _save_on(rank: int, path: str, world: int) -> None:
    mesh = _init(world)
    checkpoint.save(_shard(_full_state(), mesh), path)


def _load_on(rank: int, path: str, world: int) -> dict:
    mesh = _init(world)
    back = checkpoint.load(path, _shard(_full_state(seed=6), mesh))
    rows = tuple(back.params["0.weight"].to_local().shape)
    return {"full": _plain(back), "rows": rows, "world": checkpoint.read_meta(path)["world_size"]}


@pytest.mark.parametrize(("saved_on", "loaded_on"), [(1, 2), (2, 1)])
def test_a_sharded_checkpoint_reshards_onto_another_world_size(tmp_path, saved_on, loaded_on):
    path = str(tmp_path / "c")
    run_ranks(_save_on, saved_on, path, saved_on, timeout=TIMEOUT)
    results = run_ranks(_load_on, loaded_on, path, loaded_on, timeout=TIMEOUT)
    for r in results:
        _bitwise(r["full"], _plain(_full_state()))
        assert r["world"] == saved_on
    assert [r["rows"] for r in results] == ([(3, 3), (2, 3)] if loaded_on == 2 else [(5, 3)])


def _save_async_while_training(rank: int, path: str) -> dict:
    import torch.distributed as dist

    mesh = _init()
    state = _shard(_full_state(), mesh)
    future = checkpoint.save_async(state, path, fingerprint=True)
    for _ in range(20):  # the training goes on: its collectives, its in-place updates
        for p in state.params.values():
            p.detach().to_local().add_(1.0)
        dist.all_reduce(torch.ones(3))
    done = future.result(timeout=TIMEOUT)
    second = checkpoint.save_async(state, f"{path}-2").result(timeout=TIMEOUT)
    return {"path": str(done), "second": str(second), "after": _plain(state)}


def test_save_async_of_a_sharded_state_writes_the_values_of_the_call(tmp_path):
    path = tmp_path / "c"
    results = run_ranks(_save_async_while_training, 2, str(path), timeout=TIMEOUT)
    assert all(r["path"] == str(path) for r in results)
    reference = _full_state()
    back = checkpoint.load(path, _full_state(seed=2))
    _bitwise(_plain(back), _plain(reference))  # not the values updated after the call
    assert checkpoint.read_meta(path)["fingerprint"] == reference.fingerprint()
    later = checkpoint.load(tmp_path / "c-2", _full_state(seed=2))
    _bitwise(_plain(later), results[0]["after"])


# --------------------------------------------------------------------------- hostile


def test_a_bit_flip_in_any_file_is_refused_naming_it(tmp_path):
    path = _saved(tmp_path)
    names = [*checkpoint.read_meta(path)["files"], "meta.json"]
    assert len(names) == 4
    for name in names:
        file = path / name
        raw = bytearray(file.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        file.write_bytes(bytes(raw))
        with pytest.raises(CheckpointError, match=rf"{name.split('/')[-1]}.*(checksum|damaged)"):
            checkpoint.load(path, _full_state())
        assert not checkpoint.inspect(path)["verified"] if name != "meta.json" else True
        raw[len(raw) // 2] ^= 0x10
        file.write_bytes(bytes(raw))
        checkpoint.verify(path)  # intact again


def test_an_index_that_would_run_code_is_refused_even_with_valid_checksums(tmp_path):
    import pickle

    path = _saved(tmp_path)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (path / "shards" / ".metadata").write_bytes(pickle.dumps(Payload()))
    meta = checkpoint.read_meta(path)  # forged: checksums and sizes of the new file recorded
    meta["files"]["shards/.metadata"] = _checksum(path / "shards" / ".metadata")
    meta["sizes"]["shards/.metadata"] = (path / "shards" / ".metadata").stat().st_size
    (path / "meta.json").write_bytes(_meta.encode(meta))
    with pytest.raises(CheckpointError, match=r"\.metadata: refused.*never runs code"):
        checkpoint.load(path, _full_state())
    assert not marker.exists()


def test_a_file_not_named_in_meta_is_refused(tmp_path):
    path = _saved(tmp_path)
    (path / "shards" / "__2_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="does not name"):
        checkpoint.verify(path)


def _save_then_die(rank: int, path: str, victim: int, report: str, background: bool) -> None:
    """Save state A; then save state B to the same path, ``victim`` SIGKILLed while its DCP
    writer is half way through its file. The other rank records what it saw."""
    from torch.distributed.checkpoint import filesystem

    mesh = _init()
    checkpoint.save(_shard(_full_state(), mesh), path)
    if rank == victim:
        original = filesystem._write_item

        def dying(*args, **kwargs):
            out = original(*args, **kwargs)
            stream = args[1] if len(args) > 1 else None
            if hasattr(stream, "flush"):
                stream.flush()
            os.kill(os.getpid(), signal.SIGKILL)
            return out

        filesystem._write_item = dying
    try:
        if background:
            checkpoint.save_async(_shard(_full_state(seed=1), mesh), path).result(TIMEOUT)
        else:
            checkpoint.save(_shard(_full_state(seed=1), mesh), path)
        said = "saved"
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    Path(report).write_text(said)
    os._exit(0)  # the process group cannot be torn down with a dead peer


@pytest.mark.parametrize(("victim", "background"), [(1, False), (0, False), (1, True)])
def test_sigkill_of_a_rank_mid_save_leaves_the_previous_checkpoint(tmp_path, victim, background):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    path, report = ckpts / "last", tmp_path / "report.txt"
    with pytest.raises((RuntimeError, AssertionError, TimeoutError)):
        run_ranks(_save_then_die, 2, str(path), victim, str(report), background, timeout=TIMEOUT)
    said = report.read_text()  # the survivor did not hang: it heard of the failure
    assert said.startswith("CheckpointError"), said
    checkpoint.clean_leftovers(ckpts)
    assert sorted(os.listdir(ckpts)) == ["last"]
    _bitwise(_plain(checkpoint.load(path, _full_state(seed=2))), _plain(_full_state()))


def _one_rank_fails(rank: int, path: str) -> str:
    from torch.distributed.checkpoint import filesystem

    mesh = _init()
    checkpoint.save(_shard(_full_state(), mesh), path)
    if rank == 1:

        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")

        filesystem._write_item = full_disk
    try:
        checkpoint.save(_shard(_full_state(seed=1), mesh), path)
    except CheckpointError as e:
        return str(e)
    return "saved"


def test_a_failure_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    path = tmp_path / "c"
    said = run_ranks(_one_rank_fails, 2, str(path), timeout=TIMEOUT)
    assert all("No space left" in s or "rank 1" in s for s in said), said
    assert sorted(os.listdir(tmp_path)) == ["c"]  # nothing left behind
    _bitwise(_plain(checkpoint.load(path, _full_state(seed=2))), _plain(_full_state()))


def test_a_sharded_state_without_a_process_group_is_refused_at_save(tmp_path):
    meta_file = tmp_path / "none"
    assert not meta_file.exists()
    with pytest.raises(CheckpointError, match="no process group"):
        # a DTensor needs a mesh, hence a process group: refuse a sharded state the check
        # sees without one by handing _dcp.save a state it classifies as sharded
        from engine.parallel import _dcp

        _dcp.save(
            _full_state(),
            meta_file,
            metrics=None,
            extra=None,
            fingerprint=False,
            weights_only=False,
            rank_grad_accum=(),
        )


def test_meta_json_of_a_sharded_checkpoint_is_checked_against_its_schema(tmp_path):
    path = _saved(tmp_path)
    meta = checkpoint.read_meta(path)
    for change, message in (
        ({"format_version": 5}, "'layout' is 'sharded' in a format version 5"),
        ({"files": {**meta["files"], "../x": "y"}}, "not a plain file name"),
        ({"world_size": 0}, "'world_size' must be an int >= 1"),
    ):
        (path / "meta.json").write_bytes(_meta.encode({**meta, **change}))
        with pytest.raises(CheckpointError, match=message):
            checkpoint.read_meta(path)
    doc = json.loads(_meta.encode(meta))
    assert doc["layout"] == "sharded"


# --------------------------------------------------------------------------- the Trainer

FIT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import engine as eg
    from engine import optim

    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g))
    loader = DataLoader(ds, batch_size=8, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))

    def loss_fn(m, b):
        return F.mse_loss(m(b[0]), b[1])

    saver = eg.listeners.ModelCheckpoint(
        dirpath=os.path.join(args["root"], "ckpts"), filename="{step}", save_top_k=-1,
        every_n_train_steps=2, asynchronous=args.get("asynchronous", False))
    task = eg.Task(loss_fn, optim.adamw(1e-2, weight_decay=0.01))
    trainer = eg.Trainer(
        accelerator="cpu", strategy=args["strategy"], devices=args["devices"], max_epochs=2,
        gradient_clip_val=0.5, default_root_dir=args["root"], enable_progress_bar=False,
        enable_model_summary=False, callbacks=[saver], log_every_n_steps=1,
        enable_journal=False,  # a sharded run has none (its fingerprints need every rank)
    )
    out = trainer.fit(task, task.init(model, seed=0), loader, ckpt_path=args.get("ckpt"))
    fp = out.fingerprint()  # of the gathered values: a collective under fsdp
    def full(v):
        return v.full_tensor() if hasattr(v, "full_tensor") else v
    params = {k: full(v.detach()) for k, v in out.params.items()}
    opt = {k: full(v) for k, v in optim.base.state_dict(out.opt_state).items()}
    if trainer.is_global_zero:
        torch.save({"fp": fp, "params": params, "opt": opt, "step": out.step},
                   os.path.join(args["root"], "final.pt"))
    """
)


def _fit(root: Path, **args):
    from test_ddp_trainer import _ok, _python, _torchrun

    root.mkdir(parents=True, exist_ok=True)
    script = root / "fit.py"
    script.write_text(FIT)
    run = _torchrun if args.get("devices", 2) == 2 else _python
    proc = run(script, {"strategy": "fsdp", "devices": 2, "root": str(root), **args}, timeout=240)
    _ok(proc)
    return torch.load(root / "final.pt", weights_only=False)


def test_trainer_fsdp_checkpoints_resume_bitwise_on_two_ranks_and_gather_on_one(tmp_path):
    full = _fit(tmp_path / "full")  # 4 batches of 8 per rank and epoch: steps 1..8
    ckpts = tmp_path / "full" / "ckpts"
    saved = sorted(os.listdir(ckpts))
    assert saved == ["step=2", "step=4", "step=6", "step=8"], saved
    assert checkpoint.read_meta(ckpts / "step=2")["layout"] == "sharded"
    # resumed on 2 ranks mid-epoch: the same run, bitwise
    resumed = _fit(tmp_path / "resumed", ckpt=str(ckpts / "step=2"))
    assert resumed["step"] == full["step"] == 8
    assert resumed["fp"] == full["fp"]
    # the last checkpoint on 1 process, no process group: the gathered values, bitwise
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    template = eg.TrainState.create(model, optim.adamw(1e-2, weight_decay=0.01))
    back = checkpoint.load(ckpts / "step=8", template)  # the counters: of the step's end
    _bitwise({k: v.detach() for k, v in back.params.items()}, full["params"])
    opt = optim.base.state_dict(back.opt_state)
    for k, v in full["opt"].items():
        assert torch.equal(opt[k], v) if isinstance(v, torch.Tensor) else opt[k] == v, k
    # and a fit on 1 process continues from the 2-rank checkpoint
    one = _fit(tmp_path / "one", devices=1, strategy="auto", ckpt=str(ckpts / "step=2"))
    assert one["step"] > 2


def test_trainer_fsdp_asynchronous_checkpoints_equal_the_synchronous_ones(tmp_path):
    sync = _fit(tmp_path / "sync")
    background = _fit(tmp_path / "async", asynchronous=True)
    assert background["fp"] == sync["fp"]
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    template = eg.TrainState.create(model, optim.adamw(1e-2, weight_decay=0.01))
    for name in ("step=2", "step=8"):
        a = checkpoint.load(tmp_path / "sync" / "ckpts" / name, template)
        b = checkpoint.load(tmp_path / "async" / "ckpts" / name, template)
        _bitwise(_plain(a), _plain(b))
        assert checkpoint.read_meta(tmp_path / "async" / "ckpts" / name)["fingerprint"]
