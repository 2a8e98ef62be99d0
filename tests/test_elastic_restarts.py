"""torchrun restarts (issue 27): a rank killed (SIGKILL) or preempted (SIGTERM) in the first
attempt, ``torchrun --max-restarts=1`` starts the group again (``--standalone`` and an explicit
c10d rendezvous with a run id), and the restarted workers join, resume from the checkpoint they
should (the journal's start lines say which) and finish where the uninterrupted run finishes:
the state bitwise, ``metrics.csv`` byte for byte, the TensorBoard scalars and every step's loss
once, and ``engine replay`` vouches for the steps of both attempts.

Real torchrun on purpose: its agent shares the rendezvous's TCP store with the workers (torch's
default since 2.4), and a restarted attempt joined through the keys the previous one left there
(pytorch/pytorch#135712): ``Gloo connectFullMesh failed ... Connection refused`` or a hang in 2
of 3 plain runs before DDP's setup gave each attempt a store prefix of its own.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import _procs
import pytest
import torch
from _ranks import free_port
from test_ddp_trainer import _env, _ok
from test_loggers import _scalars

import engine as eg

pytestmark = pytest.mark.budget(
    share=0.12,
    why="a restart is torchrun's agent restarting its workers: real torchrun, four attempts' "
    "worth of cold ranks (the point: the agent's shared store outlives an attempt)",
)

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch, torch.nn.functional as F
    import engine as eg
    from engine import optim
    from engine.listeners import ModelCheckpoint
    from engine.loggers import CSVLogger, TensorBoardLogger

    root, strategy, sig, logs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    nodes = int(sys.argv[5]) if len(sys.argv) > 5 else 1  # agents, one rank each when 2
    rank = int(os.environ["RANK"])
    killed = os.path.join(root, "killed")  # once: each node's agent counts its own restarts

    at = int(os.environ.get("KILL_AT_STEP", "7"))

    class Killer(eg.Listener):  # rank 1 dies at step 7 of the first attempt
        def on_train_batch_end(self, rec):
            if sig != "none" and rank == 1 and rec.state.step == at and not os.path.exists(killed):
                open(killed, "w").close()
                os.kill(os.getpid(), getattr(signal, sig))

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(12)]
    task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
    trainer = eg.Trainer(
        strategy=strategy, devices=2 // nodes, num_nodes=nodes, accelerator="cpu", max_epochs=2,
        # "csv": a CSV and a TensorBoard logger with version=None (a version_N shared, the
        # ModelCheckpoint directory under it, as with the default logger); "default": None
        logger=[CSVLogger(root), TensorBoardLogger(root)] if logs == "csv" else None,
        log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
        callbacks=[Killer(), ModelCheckpoint(every_n_train_steps=2, save_last=True)],
    )
    state = trainer.fit(task, task.init(torch.nn.Linear(4, 1)), data, ckpt_path="last")
    full = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in state.params.items()
    }
    if trainer.is_global_zero:
        from engine.parallel import elastic  # the attempt the ranks agreed on

        resumed = os.path.basename(trainer.ckpt_path or "-")
        print("DONE", elastic.attempt(), state.step, resumed, flush=True)
        torch.save(full, os.path.join(root, "final.pt"))
    """
)


def _restarted(
    tmp: Path, strategy: str, sig: str, logs: str = "csv", rdzv: str = "standalone"
) -> tuple[list[str], dict, str]:
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    root = tmp / f"{strategy}-{sig}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(
            ["--standalone"]
            if rdzv == "standalone"  # c10d on a free port, a run id of its own
            else [
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                "--rdzv-id=job-42",
                "--nnodes=1",
            ]
        ),
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--monitor-interval=0.5",
        str(script),
        str(root),
        strategy,
        sig,
        logs,
    ]
    proc = _procs.run(cmd, env=_env(), capture_output=True, text=True, timeout=150)
    _ok(proc)
    done = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("DONE")]
    final = torch.load(root / "final.pt", weights_only=True)
    return done[0] if done else [], final, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, sig, resumed_from, rdzv",
    [
        ("ddp", "SIGKILL", "last", "standalone"),  # the last checkpoint, step 6
        ("ddp", "SIGTERM", "interrupted-step=7", "c10d"),  # the signal's own checkpoint
        ("fsdp", "SIGKILL", "last", "c10d"),
        ("fsdp", "SIGTERM", "interrupted-step=7", "standalone"),
    ],
)
def test_a_restarted_attempt_joins_resumes_and_ends_bitwise(
    tmp_path_factory, tmp_path, strategy, sig, resumed_from, rdzv
):
    reference = tmp_path_factory.getbasetemp() / f"uninterrupted-{strategy}"
    if not (reference / f"{strategy}-none" / "final.pt").is_file():
        reference.mkdir(exist_ok=True)
        assert _restarted(reference, strategy, "none")[0] == ["0", "24", "-"]  # the run unkilled
    expected = torch.load(reference / f"{strategy}-none" / "final.pt", weights_only=True)
    done, final, _ = _restarted(tmp_path, strategy, sig, rdzv=rdzv)
    # the second attempt finished, from the checkpoint the first one left, not from step 0
    assert done == ["1", "24", resumed_from]
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in expected)

    # where it resumed, by the journal: a second start line at the checkpoint's step, naming
    # it, and the next step the one after it (item 4: the resume point, not only the end)
    run_dir = tmp_path / f"{strategy}-{sig}" / "lightning_logs" / "version_0"
    lines = [json.loads(x) for x in (run_dir / "journal.jsonl").read_text().splitlines()]
    starts = [i for i, line in enumerate(lines) if line.get("start")]
    assert len(starts) == 2, lines
    at = 6 if resumed_from == "last" else 7  # ModelCheckpoint every 2 steps; the signal's
    second = lines[starts[1]]
    assert second["step"] == at and Path(second["checkpoint"]).name == resumed_from
    after = [line["step"] for line in lines[starts[1] + 1 :] if "loss" in line]
    assert after[0] == at + 1 and after == sorted(set(after)) and after[-1] == 24
    # every step's loss once in the merged journal, each equal to the uninterrupted run's
    ref_dir = reference / f"{strategy}-none" / "lightning_logs" / "version_0"
    assert _losses(run_dir) == _losses(ref_dir)

    # the logs: the CSV byte for byte and the TensorBoard scalars as the uninterrupted run's
    assert (run_dir / "metrics.csv").read_text() == (ref_dir / "metrics.csv").read_text()
    assert _scalars(str(run_dir)) == _scalars(str(ref_dir))

    if sig == "SIGKILL":  # engine replay over both attempts: every step, bitwise
        report = eg.replay(run_dir, trust_code=True)
        assert report.identical and report.steps == 24, str(report)


def _losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss from a journal, refusing a step journaled twice with different losses."""
    out: dict[int, float] = {}
    for text in (run_dir / "journal.jsonl").read_text().splitlines():
        line = json.loads(text)
        steps = range(line["step"] - len(line.get("losses", [])) + 1, line["step"] + 1)
        for step, loss in zip(steps, line.get("losses", []), strict=True):
            assert out.setdefault(step, loss) == loss, (step, loss, out[step])
    return out


@pytest.mark.slow
def test_a_restart_with_the_default_logger_continues_in_the_first_attempts_directory(
    tmp_path_factory, tmp_path
):
    """With the defaults (a TensorBoard logger with version=None, ModelCheckpoint's directory
    under its version_N), the attempt after a restart claims the first attempt's version_N,
    finds its checkpoint there and resumes; a new version_N would have started from step 0."""
    reference = tmp_path_factory.getbasetemp() / "uninterrupted-ddp"
    if not (reference / "ddp-none" / "final.pt").is_file():
        reference.mkdir(exist_ok=True)
        assert _restarted(reference, "ddp", "none")[0] == ["0", "24", "-"]
    expected = torch.load(reference / "ddp-none" / "final.pt", weights_only=True)
    done, final, stderr = _restarted(tmp_path, "ddp", "SIGKILL", logs="default")
    assert done == ["1", "24", "last"]
    versions = sorted(p.name for p in (tmp_path / "ddp-SIGKILL" / "lightning_logs").iterdir())
    assert versions == ["version_0"]
    assert "exists and is not empty" not in stderr  # a resume into its own directory
    assert all(torch.equal(final[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_two_agents_agree_on_the_attempt_when_only_one_counted_a_restart(
    tmp_path_factory, tmp_path
):
    """Two torchrun agents of one job (two "nodes", one rank each, a c10d rendezvous): rank 1
    killed at step 7. Its agent counts a restart (TORCHELASTIC_RESTART_COUNT=1); the other
    agent restarts its worker for the new rendezvous round without counting one (0). Keyed by
    the restart count, the ranks' stores would differ; the attempt they agree on through the
    store is 1 on both, so they join, rank 0 continues in the first attempt's version_0 (its
    own count says 0: a first attempt) from its checkpoint, and ends bitwise."""
    reference = tmp_path_factory.getbasetemp() / "uninterrupted-ddp"
    if not (reference / "ddp-none" / "final.pt").is_file():
        reference.mkdir(exist_ok=True)
        assert _restarted(reference, "ddp", "none")[0] == ["0", "24", "-"]
    expected = torch.load(reference / "ddp-none" / "final.pt", weights_only=True)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    root = tmp_path / "ddp-SIGKILL"
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=job-two-nodes",
        "--max-restarts=1",  # one restart: a join lost to a stale key would use it up
        "--monitor-interval=0.5",
        str(script),
        str(root),
        "ddp",
        "SIGKILL",
        "csv",
        "2",
    ]
    import subprocess

    agents = [
        _procs.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [agent.communicate(timeout=150) for agent in agents]
    for agent, (_, err) in zip(agents, outs, strict=True):
        assert agent.returncode == 0, err[-4000:]
    (done,) = [
        ln.split()[1:] for out, _ in outs for ln in out.splitlines() if ln.startswith("DONE")
    ]
    assert done == ["1", "24", "last"]
    assert sorted(p.name for p in (root / "lightning_logs").iterdir()) == ["version_0"]
    final = torch.load(root / "final.pt", weights_only=True)
    assert all(torch.equal(final[k], expected[k]) for k in expected)
