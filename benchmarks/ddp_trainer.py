"""Data-parallel training through the Trainers against a raw DDP loop: 2 gloo CPU ranks.

    python -m benchmarks.ddp_trainer            # a table
    python -m benchmarks.ddp_trainer --json     # one JSON object
    python -m benchmarks.ddp_trainer --quick    # one round of fewer steps, quiet only

Every variant trains the same MLP (784-512-512-10, AdamW 1e-3) on the same data (a
``DataLoader`` of batch 128 a rank, sharded by ``DistributedSampler(shuffle=True)``) for
``warmup + steps`` optimizer steps, in two fresh rank processes started as torchrun starts them
(one thread each). Rank 0 times the ``steps`` measured steps from the end of the last warm-up
step to the end of the last step (``time.perf_counter`` in a listener, a Lightning callback, or
the loop itself), so start-up, compilation and the fit's end are not in the figure:

* ``raw``: ``DistributedDataParallel`` + ``torch.optim.AdamW``, a hand loop over the loader;
* ``engine_defaults``: ``eg.Trainer(strategy="ddp", devices=2)`` with its defaults (the
  journal, the TensorBoard logger, ``ModelCheckpoint``, the model summary), the progress bar
  off;
* ``engine_no_journal``: the defaults with ``enable_journal=False`` (what the journal costs);
* ``engine_barebones``: ``eg.Trainer(..., barebones=True)``;
* ``engine_compiled``: the defaults with ``compile=True``;
* ``lightning_defaults``: ``pytorch_lightning.Trainer(strategy="ddp", devices=2)`` with its
  defaults (its logger, ``ModelCheckpoint``, the model summary), the progress bar off.

The variants run interleaved, round by round (the order rotated each round), each round once
on a quiet machine and once beside a competing load (one process spinning on one core, as
another job on the machine would); a figure is the median over rounds of the per-round ratio
``variant / raw`` (``ddp_engine_defaults_vs_raw``, ...; ``..._loaded`` beside the load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = (784, 512, 512, 10)
BATCH = 128  # per rank
WORLD = 2
VARIANTS = (
    "raw",
    "engine_defaults",
    "engine_no_journal",
    "engine_barebones",
    "engine_compiled",
    "lightning_defaults",
)


def _data(total_steps: int) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    n = total_steps * BATCH * WORLD
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n, SIZES[0], generator=g), torch.randint(0, SIZES[-1], (n,), generator=g)
    )


def _model() -> Any:
    import torch

    from benchmarks.step import mlp

    torch.manual_seed(0)
    return mlp(SIZES)


def rank_main(variant: str, warmup: int, steps: int, root: str, out: str) -> None:
    """One rank of one variant; rank 0 writes ``{"seconds": ...}`` for the measured steps."""
    import warnings

    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    total = warmup + steps
    data = _data(total)
    marks: dict[int, float] = {}

    def mark(step: int) -> None:  # after optimizer step `step` (1-based)
        if step in (warmup, total):
            marks[step] = time.perf_counter()

    if variant == "raw":
        import torch.distributed as dist
        from torch.utils.data.distributed import DistributedSampler

        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(_model())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sampler = DistributedSampler(data, shuffle=True, seed=0)
        sampler.set_epoch(0)
        loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
        for i, (x, y) in enumerate(loader, start=1):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            mark(i)
            if i == total:
                break
        dist.barrier()
        dist.destroy_process_group()
    elif variant.startswith("engine"):
        import engine as eg
        from engine import optim

        class Clock(eg.Listener):
            may_stop = False  # it only reads the clock: the Trainer's defaults stay as they are

            def on_train_batch_end(self, rec: Any) -> None:
                mark(rec.state.step)

        task = eg.Task(lambda m, b: F.cross_entropy(m(b[0]), b[1]), optim.adamw(1e-3))
        strategy: Any = "ddp"
        if variant == "engine_compiled_overlap":  # an experiment: small buckets, reordered
            import torch._inductor.config as inductor

            from engine.parallel import DDP

            inductor.reorder_for_compute_comm_overlap = True
            strategy = DDP(bucket_cap_mb=float(os.environ.get("BUCKET_MB", "0.5")))
        flags: dict[str, Any] = (
            {"barebones": True} if variant == "engine_barebones" else {"enable_progress_bar": False}
        )
        trainer = eg.Trainer(
            accelerator="cpu",
            strategy=strategy,
            devices=WORLD,
            max_steps=total,
            default_root_dir=root,
            callbacks=[Clock()],
            compile=variant.startswith("engine_compiled"),
            **flags,
            **({"enable_journal": False} if variant == "engine_no_journal" else {}),
        )
        loader = DataLoader(data, batch_size=BATCH, shuffle=True)
        trainer.fit(task, task.init(_model(), seed=0), loader)
    else:
        import pytorch_lightning as pl

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = _model()

            def training_step(self, batch: Any, i: int) -> Any:
                return F.cross_entropy(self.net(batch[0]), batch[1])

            def configure_optimizers(self) -> Any:
                return torch.optim.AdamW(self.parameters(), lr=1e-3)

        class Clock(pl.Callback):
            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                mark(trainer.global_step)

        trainer = pl.Trainer(
            accelerator="cpu",
            strategy="ddp",
            devices=WORLD,
            max_steps=total,
            default_root_dir=root,
            callbacks=[Clock()],
            enable_progress_bar=False,
        )
        loader = DataLoader(data, batch_size=BATCH, shuffle=True)
        trainer.fit(Module(), loader)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": marks[total] - marks[warmup]}))


def _launch(variant: str, warmup: int, steps: int, timeout: float) -> float:
    """Both ranks of ``variant`` in fresh processes; rank 0's seconds for the measured steps."""
    from benchmarks.ddp import _free_port

    with tempfile.TemporaryDirectory(prefix=f"ddp-{variant}-") as root:
        out = os.path.join(root, "rank0.json")
        port = _free_port()
        procs = []
        for rank in range(WORLD):
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GROUP_RANK": "0",
                "WORLD_SIZE": str(WORLD),
                "LOCAL_WORLD_SIZE": str(WORLD),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": "none",
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0",
            }
            cmd = [sys.executable, "-m", "benchmarks.ddp_trainer", "--rank-main", variant]
            cmd += ["--warmup", str(warmup), "--steps", str(steps), "--root", root, "--out", out]
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            )
        errors = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"{variant}: a rank ran past {timeout:.0f} s") from None
            if p.returncode:
                errors.append(err.decode(errors="replace")[-3000:])
        if errors:
            raise RuntimeError(f"{variant} failed:\n{errors[0]}")
        return json.loads(Path(out).read_text())["seconds"]


def _load() -> subprocess.Popen[bytes]:
    """A competing job: one process spinning on one core until killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run(
    rounds: int = 5,
    warmup: int = 20,
    steps: int = 100,
    loaded: bool = True,
    timeout: float = 600,
    variants: tuple[str, ...] = VARIANTS,
) -> dict[str, Any]:
    times: dict[str, dict[str, list[float]]] = {}
    conditions = ("quiet", "loaded") if loaded else ("quiet",)
    for r in range(rounds):
        for condition in conditions:
            load = _load() if condition == "loaded" else None
            try:
                order = variants[r % len(variants) :] + variants[: r % len(variants)]
                for v in order:
                    seconds = _launch(v, warmup, steps, timeout)
                    times.setdefault(condition, {}).setdefault(v, []).append(seconds / steps)
                    print(
                        f"round {r} {condition} {v}: {seconds / steps * 1e3:.2f} ms a step",
                        file=sys.stderr,
                    )
            finally:
                if load is not None:
                    load.kill()
                    load.wait()
    out: dict[str, Any] = {
        "shape": list(SIZES),
        "batch_per_rank": BATCH,
        "rounds": rounds,
        "steps": steps,
        "warmup": warmup,
    }
    for condition, by_variant in times.items():
        suffix = "" if condition == "quiet" else "_loaded"
        raw = by_variant["raw"]
        out[f"ddp_raw_step_ms{suffix}"] = statistics.median(raw) * 1e3
        for v, ts in by_variant.items():
            if v == "raw":
                continue
            ratios = [t / b for t, b in zip(ts, raw, strict=True)]
            out[f"ddp_{v}_vs_raw{suffix}"] = statistics.median(ratios)
            out[f"ddp_{v}_vs_raw{suffix}_rounds"] = ratios
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", help="comma-separated (default: all)")
    p.add_argument("--quiet-only", action="store_true", help="no round beside a load")
    p.add_argument("--rank-main", help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_main:
        from benchmarks.ddp import exit_rank

        rank_main(args.rank_main, args.warmup, args.steps, args.root, args.out)
        exit_rank()
    if args.quick:
        results = run(rounds=1, warmup=5, steps=20, loaded=False)
    else:
        chosen = tuple(args.variants.split(",")) if args.variants else VARIANTS
        if "raw" not in chosen:
            chosen = ("raw", *chosen)
        results = run(
            rounds=args.rounds,
            warmup=args.warmup,
            steps=args.steps,
            loaded=not args.quiet_only,
            variants=chosen,
        )
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for k, v in results.items():
            if not k.endswith("_rounds"):
                print(f"{k:45} {v}")


if __name__ == "__main__":
    main()
