"""Sharded save and load (engine.checkpoint on a DTensor state) against
``torch.distributed.checkpoint`` called directly on the same tensors, on 2 gloo CPU ranks.

    python -m benchmarks.sharded_checkpoint [--mib 256] [--repeat 3]

The state: one parameter of ``--mib`` MiB (float32, rows sharded over the ranks) and AdamW's two
moments like it, so ``3 * mib`` MiB in all, half on each rank. ``engine`` is
``checkpoint.save`` (agreement, DCP's write with fsync, rank 0's checksums of every file,
meta.json, rename) and ``checkpoint.load`` (every file's checksum, DCP's read into the
template's DTensors); ``dcp`` is ``dcp.save`` / ``dcp.load`` of the same flat dict into a fresh
directory. The best of ``--repeat`` runs of each, in seconds, printed as JSON by rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _rank(rank: int, mib: int, repeat: int, root: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import engine as eg
    from engine import checkpoint, optim

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows = mib * 2**20 // (4 * 1024)
    full = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(0))
    w = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None).requires_grad_()
    tx = optim.adamw(1e-3)
    opt = tx.init({"w": w})
    state = eg.TrainState(params={"w": w}, opt_state=opt)
    tensors = {"params/w": w.detach()}
    tensors.update(
        (f"opt_state/{k}", v)
        for k, v in optim.base.state_dict(opt).items()
        if isinstance(v, torch.Tensor)
    )
    keys = ("engine_save", "dcp_save", "engine_load", "dcp_load")
    times: dict[str, list[float]] = {k: [] for k in keys}

    def timed(key: str, fn) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times[key].append(time.perf_counter() - t0)

    for i in range(repeat):
        ours, theirs = Path(root) / f"engine-{i}", Path(root) / f"dcp-{i}"
        target = {k: torch.empty_like(v) for k, v in tensors.items()}
        writer = dcp.FileSystemWriter(theirs, sync_files=True)
        timed("engine_save", lambda ours=ours: checkpoint.save(state, ours))
        timed("dcp_save", lambda w=writer: dcp.save(tensors, storage_writer=w))
        timed("engine_load", lambda ours=ours: checkpoint.load(ours, state))
        reader = dcp.FileSystemReader(theirs)
        timed("dcp_load", lambda t=target, r=reader: dcp.load(t, storage_reader=r))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(ours)
            shutil.rmtree(theirs)
    return {k: min(v) for k, v in times.items()}


def main() -> None:
    from _ranks import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB of the parameter")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        best = run_ranks(_rank, 2, args.mib, args.repeat, root, timeout=1200)[0]
    total = 3 * args.mib
    best = {k: round(v, 4) for k, v in best.items()}
    ratio = {
        "save": round(best["engine_save"] / best["dcp_save"], 3),
        "load": round(best["engine_load"] / best["dcp_load"], 3),
    }
    print(json.dumps({"state_mib": total, "ranks": 2, "seconds": best, "engine_over_dcp": ratio}))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
