"""Cluster environments (faked variables) and the launchers (real processes, gloo on the CPU).

The ScriptLauncher tests run a small script in a fresh interpreter, as a user runs theirs: its
ranks form a gloo group from the variables the launcher set (``init_method="env://"``) and
all-reduce ``rank + 1``; every process wait has a timeout, so a hang fails the test.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import time

import _procs
import pytest
import torch
import torch.distributed as dist

import engine as eg
from engine import optim
from engine.parallel import environments as envs
from engine.parallel import launch
from engine.parallel.environments import (
    LAUNCHED_BY_VAR,
    ClusterEnvironment,
    LocalEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    expand_slurm_nodelist,
    select_environment,
)
from engine.parallel.launch import (
    ChildProcessFailed,
    ScriptLauncher,
    SpawnLauncher,
    find_free_port,
)

_DIST_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    LAUNCHED_BY_VAR,
    # the ranks share one stdout pipe: unbuffered, print's pieces interleave mid-line
    "PYTHONUNBUFFERED",
)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    """No variable of a launcher or scheduler this test did not set itself."""
    for name in list(os.environ):
        if name in _DIST_VARS or name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(envs, "_launched_here", {})


# ---------------------------------------------------------------------------- environments


def test_local_environment_reads_the_launchers_variables(monkeypatch):
    env = LocalEnvironment(devices=3, num_nodes=2)
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (6, 0, 0, 0)
    assert env.main_address == "127.0.0.1"
    port = env.main_port
    assert 0 < port < 65536 and env.main_port == port  # chosen once
    assert env.creates_processes_externally is False
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29501")
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert env.main_address == "10.1.2.3" and env.main_port == 29501
    assert (env.node_rank(), env.local_rank(), env.global_rank()) == (1, 2, 1 * 3 + 2)
    assert env.creates_processes_externally is False  # variables alone: not one of ours
    monkeypatch.setenv(LAUNCHED_BY_VAR, "script:1")
    assert env.creates_processes_externally is True
    assert LocalEnvironment.detect()


def test_local_environment_refuses_out_of_range_ranks_and_other_worlds(monkeypatch):
    env = LocalEnvironment(devices=2, num_nodes=1)
    env.validate(devices=2, num_nodes=1)
    with pytest.raises(
        ValueError, match=r"devices=2, num_nodes=1\) was given to a Trainer with devices=4"
    ):
        env.validate(devices=4, num_nodes=1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 is outside range\(devices=2\)"):
        env.validate(devices=2, num_nodes=1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "1")
    with pytest.raises(ValueError, match=r"NODE_RANK=1 is outside range\(num_nodes=1\)"):
        env.validate(devices=2, num_nodes=1)
    monkeypatch.delenv("NODE_RANK")
    monkeypatch.setenv(LAUNCHED_BY_VAR, "script:1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"world of 4 processes .* devices=2 \* num_nodes=1 = 2"):
        env.validate(devices=2, num_nodes=1)
    two_nodes = LocalEnvironment(devices=1, num_nodes=2)
    monkeypatch.delenv(LAUNCHED_BY_VAR)
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(ValueError, match=r"num_nodes=2 without MASTER_PORT"):
        two_nodes.validate(devices=1, num_nodes=2)
    with pytest.raises(ValueError, match=r"devices must be an int >= 1 \(got 0\)"):
        LocalEnvironment(devices=0)
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ValueError, match=r"LOCAL_RANK must be an integer \(got 'one'\)"):
        env.local_rank()


def _torchrun_variables(monkeypatch, *, world, rank, local, group, per_node=None):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    for name, value in (
        ("WORLD_SIZE", world),
        ("RANK", rank),
        ("LOCAL_RANK", local),
        ("GROUP_RANK", group),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", 29400),
    ):
        monkeypatch.setenv(name, str(value))
    if per_node is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))


def test_torchelastic_environment_reads_torchruns_variables(monkeypatch):
    assert not TorchElasticEnvironment.detect()
    _torchrun_variables(monkeypatch, world=4, rank=3, local=1, group=1)
    assert TorchElasticEnvironment.detect()
    env = TorchElasticEnvironment()
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (4, 3, 1, 1)
    assert (env.main_address, env.main_port, env.creates_processes_externally) == (
        "node0",
        29400,
        True,
    )
    env.validate(devices=2, num_nodes=2)
    # Without the run id, the five variables of torch's convention are enough.
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert TorchElasticEnvironment.detect()
    monkeypatch.delenv("MASTER_PORT")
    assert not TorchElasticEnvironment.detect()
    # Our own launcher's children carry the same five variables: they are not torchrun's.
    monkeypatch.setenv("MASTER_PORT", "29400")
    monkeypatch.setenv(LAUNCHED_BY_VAR, "script:1")
    assert not TorchElasticEnvironment.detect()


def test_a_torchrun_world_that_is_not_devices_times_nodes_is_refused(monkeypatch):
    _torchrun_variables(monkeypatch, world=4, rank=0, local=0, group=0, per_node=2)
    with pytest.raises(ValueError) as info:
        select_environment(None, devices=1, num_nodes=2)
    message = str(info.value)
    assert "world size 4" in message and "devices=1 * num_nodes=2 = 2" in message
    assert "--nproc_per_node=2" in message and "--nproc_per_node=1 --nnodes=2" in message


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node001", ["node001"]),
        ("a,b,c", ["a", "b", "c"]),
        ("a b", ["a", "b"]),
        (
            "node[001-004,007],other",
            ["node001", "node002", "node003", "node004", "node007", "other"],
        ),
        ("gpu[9-11]", ["gpu9", "gpu10", "gpu11"]),
        ("n[3]", ["n3"]),
        ("rack[1-2]-n[01,03]", ["rack1-n01", "rack1-n03", "rack2-n01", "rack2-n03"]),
        ("x[08-10],y[1,3-4]", ["x08", "x09", "x10", "y1", "y3", "y4"]),
    ],
)
def test_slurm_nodelists_expand_in_order(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[1-3", "node]1[", "node[5-2]", "node[a-b]", ""])
def test_malformed_slurm_nodelists_are_refused(bad):
    with pytest.raises(ValueError, match="SLURM node list"):
        expand_slurm_nodelist(bad)


def _slurm_variables(monkeypatch, **values):
    defaults = dict(
        SLURM_NTASKS=4,
        SLURM_PROCID=3,
        SLURM_LOCALID=1,
        SLURM_NODEID=1,
        SLURM_NODELIST="node[007-008]",
        SLURM_JOB_ID=123456,
        SLURM_JOB_NAME="train",
    )
    defaults.update(values)
    for name, value in defaults.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))


def test_slurm_environment_reads_sruns_variables(monkeypatch):
    assert not SLURMEnvironment.detect()
    _slurm_variables(monkeypatch)
    assert SLURMEnvironment.detect()
    env = SLURMEnvironment()
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (4, 3, 1, 1)
    assert env.creates_processes_externally is True
    assert env.main_address == "node007"  # the first host of the node list
    assert env.main_port == 10000 + 123456 % 10000 == 13456  # from the job id, on every task
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.9")
    monkeypatch.setenv("MASTER_PORT", "29555")
    assert (env.main_address, env.main_port) == ("10.0.0.9", 29555)
    assert SLURMEnvironment.port_for_job("12_3") == SLURMEnvironment.port_for_job("12_3")
    assert 10000 <= SLURMEnvironment.port_for_job("12_3") < 20000
    env.validate(devices=2, num_nodes=2)


@pytest.mark.parametrize("name", ["bash", "interactive"])
def test_an_interactive_slurm_job_is_not_detected(monkeypatch, name):
    _slurm_variables(monkeypatch, SLURM_JOB_NAME=name)
    assert not SLURMEnvironment.detect()
    assert type(select_environment([], devices=1, num_nodes=1)) is LocalEnvironment


def test_slurm_mismatches_name_both_values_and_the_flag_to_change(monkeypatch):
    _slurm_variables(monkeypatch, SLURM_NTASKS_PER_NODE=2, SLURM_NNODES=2)
    with pytest.raises(ValueError, match=r"--ntasks-per-node=2.* devices=4: pass devices=2"):
        select_environment([], devices=4, num_nodes=2)
    with pytest.raises(ValueError, match=r"--nodes=2.* num_nodes=1: pass num_nodes=2"):
        select_environment([], devices=2, num_nodes=1)
    # Without the per-node variables, the total decides.
    _slurm_variables(monkeypatch, SLURM_NTASKS_PER_NODE=None, SLURM_NNODES=None)
    with pytest.raises(ValueError) as info:
        select_environment([], devices=1, num_nodes=2)
    assert "world size 4" in str(info.value) and "devices=1 * num_nodes=2 = 2" in str(info.value)
    assert "--nodes=2 --ntasks-per-node=1" in str(info.value)


class _Fixed(ClusterEnvironment):
    creates_processes_externally = True
    main_address = "10.9.9.9"
    main_port = 4242

    def world_size(self):
        return 2

    def global_rank(self):
        return 1

    def local_rank(self):
        return 0

    def node_rank(self):
        return 1

    @classmethod
    def detect(cls):
        return False


def test_selection_order_plugin_then_torchelastic_then_slurm_then_local(monkeypatch):
    assert type(select_environment(None, devices=2, num_nodes=1)) is LocalEnvironment
    _slurm_variables(monkeypatch)
    assert type(select_environment([], devices=2, num_nodes=2)) is SLURMEnvironment
    _torchrun_variables(monkeypatch, world=4, rank=3, local=1, group=1)
    assert type(select_environment([], devices=2, num_nodes=2)) is TorchElasticEnvironment
    mine = _Fixed()
    assert select_environment(["16-mixed", mine], devices=1, num_nodes=2) is mine
    with pytest.raises(ValueError, match=r"_Fixed: the cluster says world size 2"):
        select_environment([mine], devices=2, num_nodes=2)
    with pytest.raises(ValueError, match=r"2 cluster environments \(_Fixed, _Fixed\)"):
        select_environment([mine, _Fixed()], devices=1, num_nodes=2)
    with pytest.raises(TypeError, match=r"pass an instance, plugins=\[_Fixed\(\)\]"):
        select_environment([_Fixed], devices=1, num_nodes=2)
    # A process our launcher started is ours, whatever scheduler surrounds it.
    monkeypatch.setenv(LAUNCHED_BY_VAR, "script:1")
    monkeypatch.setenv("NODE_RANK", "1")
    env = select_environment([], devices=2, num_nodes=2)
    assert type(env) is LocalEnvironment and env.global_rank() == 1 * 2 + 1


# ---------------------------------------------------------------------------- ScriptLauncher

_SCRIPT = textwrap.dedent(
    """
    import atexit, datetime, os, sys, time
    import torch, torch.distributed as dist
    from engine.parallel.environments import select_environment
    from engine.parallel.launch import ChildProcessFailed, ScriptLauncher

    mode, devices, nodes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    local = int(os.environ.get("LOCAL_RANK", 0))

    def say(line):  # one write(2) per line: two processes share the pipe, lines stay whole
        os.write(1, (line + "\\n").encode())

    def work(call):
        if mode == "exit-before-joining" and local == 1:
            sys.exit(3)
        dist.init_process_group(
            "gloo", init_method="env://", timeout=datetime.timedelta(seconds=40)
        )
        # As engine's strategies do: a process leaving with its group alive (sys.exit
        # mid-run) tears it down first, or gloo's threads may abort the exit (SIGABRT)
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
        rank = dist.get_rank()
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        say(
            f"{call} rank={rank} local={local} node={os.environ['NODE_RANK']} "
            f"world={dist.get_world_size()} sum={t.item():g}"
        )
        if mode == "exit-in-collective" and local == 1:
            sys.exit(3)
        if mode == "exit-in-compute" and local == 1:
            sys.exit(3)
        if mode == "exit-in-compute":
            while True:  # pure Python: no collective to notice the death
                sum(range(1000))
        if mode == "rank0-raises" and rank == 0:
            raise ValueError("rank 0 broke")
        if mode == "exit-in-collective":
            # rank 1 is gone; waited on here, as a strategy's bucketed reduce does, so that
            # the innermost Python frame is not torch.distributed's
            dist.all_reduce(t, async_op=True).wait()
        if mode == "rank0-raises":
            dist.all_reduce(t)  # waits here for rank 0, which raised
        dist.destroy_process_group()
        return t.item()

    start = time.monotonic()
    launcher = ScriptLauncher(
        devices, nodes, select_environment([], devices=devices, num_nodes=nodes), kill_after=6
    )
    try:
        result = launcher.launch(work, "fit")
    except ChildProcessFailed as e:
        say(f"CAUGHT {type(e).__name__} after {time.monotonic() - start:.1f}s: {e}")
        raise SystemExit(1)
    say(f"returned local={local} {result:g}")
    if mode == "two-calls":  # fit, then test: the children meet the parent at both
        again = ScriptLauncher(
            devices, nodes, select_environment([], devices=devices, num_nodes=nodes)
        )
        say(f"returned again local={local} {again.launch(work, 'test'):g}")
    if mode == "exit-after" and local == 1:
        sys.exit(4)
    """
)


def _run(args, *, cwd, env=None, timeout=90):
    """Run a command as a user would, with one thread and none of our launcher's variables."""
    base = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    base.update(OMP_NUM_THREADS="1", **(env or {}))
    start = time.monotonic()
    proc = _procs.run(
        args, cwd=cwd, env=base, capture_output=True, text=True, timeout=timeout, check=False
    )
    return proc, time.monotonic() - start


def _script(tmp_path, mode, devices=2, nodes=1, env=None):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    return _run(
        [sys.executable, str(script), mode, str(devices), str(nodes)], cwd=tmp_path, env=env
    )


@pytest.mark.slow
def test_script_launcher_runs_the_script_again_and_every_rank_all_reduces(tmp_path):
    proc, _ = _script(tmp_path, "two-calls")
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stdout.splitlines())
    assert lines == [
        "fit rank=0 local=0 node=0 world=2 sum=3",
        "fit rank=1 local=1 node=0 world=2 sum=3",
        "returned again local=0 3",
        "returned again local=1 3",
        "returned local=0 3",
        "returned local=1 3",
        "test rank=0 local=0 node=0 world=2 sum=3",
        "test rank=1 local=1 node=0 world=2 sum=3",
    ]


@pytest.mark.slow
def test_script_launcher_runs_a_module_again_with_dash_m(tmp_path):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(_SCRIPT)
    proc, _ = _run([sys.executable, "-m", "mypkg.train", "plain", "2", "1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("fit")) == [
        "fit rank=0 local=0 node=0 world=2 sum=3",
        "fit rank=1 local=1 node=0 world=2 sum=3",
    ]


def test_a_later_call_in_the_launching_script_must_ask_for_the_same_world(monkeypatch):
    monkeypatch.setattr(envs, "_launched_here", {"script": (2, 1)})
    launcher = ScriptLauncher(4, 1, LocalEnvironment(4, 1))
    with pytest.raises(ValueError, match=r"already launched devices=2, num_nodes=1.*devices=4"):
        launcher.launch(print)
    # In a child (or under torchrun) the launcher only runs the work.
    monkeypatch.setattr(envs, "_launched_here", {})
    monkeypatch.setenv(LAUNCHED_BY_VAR, "script:1")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert ScriptLauncher(4, 1, LocalEnvironment(4, 1)).launch(lambda: os.getpid()) == os.getpid()


def test_one_process_launches_nothing_and_leaves_the_environment_alone():
    before = dict(os.environ)
    assert ScriptLauncher(1, 1, LocalEnvironment(1, 1)).launch(lambda x: x + 1, 6) == 7
    assert dict(os.environ) == before and envs._launched_here == {}


def test_script_launcher_refuses_python_dash_c(tmp_path):
    code = (
        "from engine.parallel.environments import LocalEnvironment\n"
        "from engine.parallel.launch import ScriptLauncher\n"
        "ScriptLauncher(2, 1, LocalEnvironment(2, 1)).launch(print, 'never')\n"
    )
    proc, _ = _run([sys.executable, "-c", code], cwd=tmp_path, timeout=60)
    assert proc.returncode == 1
    assert "RuntimeError" in proc.stderr and "python -c" in proc.stderr
    assert "strategy='ddp_spawn'" in proc.stderr and "never" not in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exit-in-collective", "exit-in-compute"])
def test_a_child_that_exits_3_fails_rank_0_with_its_rank_and_code(tmp_path, mode):
    proc, elapsed = _script(tmp_path, mode)
    caught = [line for line in proc.stdout.splitlines() if line.startswith("CAUGHT")]
    assert len(caught) == 1, (proc.stdout, proc.stderr)
    assert "ChildProcessFailed" in caught[0]
    assert "local rank 1 (global rank 1, pid" in caught[0] and "exit code 3" in caught[0]
    assert float(caught[0].split(" after ")[1].split("s:")[0]) < 15
    # The script's own exit status is the failed child's, whatever it exits with itself.
    assert proc.returncode == 3 and elapsed < 60


@pytest.mark.slow
def test_a_child_that_dies_before_the_rendezvous_does_not_hang_rank_0(tmp_path):
    # Rank 0 waits in C++ for rank 1 to join the store: no Python runs to take an exception,
    # so the watcher ends the process after kill_after (6 s in the script).
    proc, elapsed = _script(tmp_path, "exit-before-joining")
    assert proc.returncode == 3
    assert "local rank 1 (global rank 1, pid" in proc.stderr and "exit code 3" in proc.stderr
    assert "did not stop within 6 s" in proc.stderr and elapsed < 60


@pytest.mark.slow
def test_rank_0_raising_stops_the_children_and_reports_its_own_error(tmp_path):
    proc, elapsed = _script(tmp_path, "rank0-raises")
    assert proc.returncode == 1 and elapsed < 60
    assert "ValueError: rank 0 broke" in proc.stderr
    assert "CAUGHT" not in proc.stdout  # rank 0's error is not dressed up as a child's


@pytest.mark.slow
def test_a_child_failing_after_the_call_makes_the_scripts_exit_status_non_zero(tmp_path):
    proc, _ = _script(tmp_path, "exit-after")
    assert "returned local=0 3" in proc.stdout and "returned local=1 3" in proc.stdout
    assert proc.returncode == 4
    assert "local rank 1 (global rank 1, pid" in proc.stderr and "exit code 4" in proc.stderr


@pytest.mark.slow
def test_two_nodes_on_loopback_join_one_group(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    port = str(find_free_port())
    base = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    procs = [
        _procs.Popen(
            [sys.executable, str(script), "plain", "1", "2"],
            cwd=tmp_path,
            env=dict(
                base,
                OMP_NUM_THREADS="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                NODE_RANK=str(node),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    assert outputs[0][0].splitlines()[0] == "fit rank=0 local=0 node=0 world=2 sum=3"
    assert outputs[1][0].splitlines()[0] == "fit rank=1 local=0 node=1 world=2 sum=3"


# ---------------------------------------------------------------------------- SpawnLauncher

_FORK = "fork" in multiprocessing.get_all_start_methods()
needs_fork = pytest.mark.skipif(not _FORK, reason="the platform has no fork")


def _all_reduce_rank():
    dist.init_process_group("gloo", init_method="env://")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "local": os.environ["LOCAL_RANK"], "sum": t}


def _raise_on_rank_1():
    if os.environ["RANK"] == "1":
        raise KeyError("rank 1 has no such key")
    time.sleep(120)  # rank 0 would wait for ever: it must be stopped


def _system_exit_on_rank_1():
    if os.environ["RANK"] == "1":
        sys.exit("rank 1 gives up")
    time.sleep(120)


def _exit_on_rank_1():
    if os.environ["RANK"] == "1":
        os._exit(3)
    time.sleep(120)


@needs_fork
def test_spawn_launcher_returns_rank_0s_value():
    out = SpawnLauncher(2, start_method="fork", timeout=60).launch(_all_reduce_rank)
    assert out["rank"] == 0 and out["world"] == 2 and out["local"] == "0"
    assert torch.equal(out["sum"], torch.tensor([3.0]))


@pytest.mark.slow
def test_spawn_launcher_brings_a_train_state_back_usable():
    torch.manual_seed(5)
    model = torch.nn.Linear(3, 2)
    tx = optim.adamw(1e-3)  # a closure: it travels to the children by cloudpickle
    state = eg.TrainState.create(model, tx, seed=5)

    def work(st):
        rank = int(os.environ["RANK"])
        return st.replace(step=rank + 7, opt_state=tx.init(st.params))

    out = SpawnLauncher(2, start_method="spawn", timeout=90).launch(work, state)
    assert isinstance(out, eg.TrainState) and out.step == 7  # rank 0's
    assert torch.equal(out.params["weight"], model.weight.detach())
    assert out.params["weight"].device.type == "cpu"
    reference = tx.init(state.params)
    got, want = _leaves(out.opt_state), _leaves(reference)
    assert len(got) == len(want) > 0
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert out.replace(step=8).step == 8 and out.copy().step == 7
    assert isinstance(out.module, torch.nn.Linear)


def _leaves(tree):
    from torch.utils import _pytree

    return [x for x in _pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


@needs_fork
def test_a_raising_child_is_re_raised_with_its_traceback_and_the_others_stopped():
    start = time.monotonic()
    with pytest.raises(KeyError, match="rank 1 has no such key") as info:
        SpawnLauncher(2, start_method="fork", grace_period=1.0, timeout=60).launch(_raise_on_rank_1)
    assert time.monotonic() - start < 30  # rank 0's sleep(120) was cut short
    cause = str(info.value.__cause__)
    assert "spawned process 1 raised" in cause and "_raise_on_rank_1" in cause


@needs_fork
def test_a_child_that_exits_without_raising_is_named_with_its_code():
    start = time.monotonic()
    with pytest.raises(ChildProcessFailed, match=r"spawned process 1 .* exited with exit code 3"):
        SpawnLauncher(2, start_method="fork", grace_period=1.0, timeout=60).launch(_exit_on_rank_1)
    assert time.monotonic() - start < 30


@needs_fork
def test_a_child_calling_sys_exit_is_re_raised_as_its_system_exit():
    with pytest.raises(SystemExit, match="rank 1 gives up") as info:
        SpawnLauncher(2, start_method="fork", grace_period=1.0, timeout=60).launch(
            _system_exit_on_rank_1
        )
    assert "_system_exit_on_rank_1" in str(info.value.__cause__)


def test_spawn_launcher_refuses_a_start_method_the_platform_lacks(monkeypatch):
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(ValueError, match=r"start_method='fork' is not available"):
        SpawnLauncher(2, start_method="fork")
    with pytest.raises(ValueError, match=r"num_processes=0"):
        SpawnLauncher(0)


def test_find_free_port_is_bindable():
    import socket

    port = find_free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_spawn_launcher_refuses_to_launch_from_a_child_importing_the_script(monkeypatch):
    # What a spawned process meets when the script runs its fit at import (no main guard).
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError, match=r"under `if __name__ == '__main__':`"):
        SpawnLauncher(2, start_method="spawn").launch(print)


class _Exited:
    def __init__(self, exitcode: int | None, pid: int = 1) -> None:
        self.exitcode, self.pid = exitcode, pid


def _record(outbox, index: int, message: str, when: float) -> None:
    import pickle

    record = {"time": when, "type": "builtins.RuntimeError", "message": message,
              "traceback": "", "exception": None}  # fmt: skip
    (outbox / f"error-{index}.pkl").write_bytes(pickle.dumps(record))


def test_the_first_recorded_error_is_the_cause_not_the_rank_torch_polled_first(tmp_path):
    # Rank 1 raised; rank 0, blocked in an all-reduce, then lost its peer: torch may poll rank 0
    # first (what CI met), and the report must still be rank 1's own error.
    _record(tmp_path, 0, "Connection closed by peer [127.0.0.1]:8093", when=2.0)
    _record(tmp_path, 1, "rank 1 gave up on purpose", when=1.0)
    processes = [_Exited(1), _Exited(1)]
    assert launch._root_cause(tmp_path, processes, detected=0) == (1, None)
    assert launch._root_cause(tmp_path, processes, detected=1) == (1, None)


def test_a_lost_peer_points_at_the_process_that_exited_without_raising(tmp_path):
    _record(tmp_path, 0, "Connection closed by peer [127.0.0.1]:8093", when=2.0)
    processes = [_Exited(1), _Exited(3)]  # rank 1: os._exit(3), no record
    assert launch._root_cause(tmp_path, processes, detected=0) == (1, 3)
    # A process killed by a signal before anyone noticed is the cause as torch saw it.
    assert launch._root_cause(tmp_path, [_Exited(1), _Exited(-9)], detected=1) == (1, -9)
    # A rank's own error (not a lost peer) is never passed over for another's exit code.
    _record(tmp_path, 0, "CUDA out of memory", when=2.0)
    assert launch._root_cause(tmp_path, processes, detected=0) == (0, None)


def test_a_half_written_error_record_is_not_taken_for_the_cause(tmp_path):
    _record(tmp_path, 1, "rank 1 broke", when=5.0)
    (tmp_path / "error-0.pkl").write_bytes(b"\x80\x04\x95")  # stopped mid-write
    assert launch._root_cause(tmp_path, [_Exited(-15), _Exited(1)], detected=1) == (1, None)
