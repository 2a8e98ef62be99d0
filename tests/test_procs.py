"""The suite's forked processes (tests/_procs.py) answer as a cold ``python`` does: the same
output, exit status, traceback, argv, path, directory, environment, stdin, signal deaths and
exit work, checked against a real cold interpreter running the same command line."""

import os
import signal
import subprocess
import sys
import time

import _procs
import pytest

PROGRAMS = {
    "argv_cwd_path": "import os, sys; print(sys.argv, os.getcwd(), repr(sys.path[0]))",
    "exit_code": "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)",
    "exit_message": "raise SystemExit('bye')",
    "traceback": "def f():\n    raise ValueError('x')\nf()",
    "main_module": "import sys; print(__name__, sys.modules['__main__'].__name__)",
    "environment": "import os; print(os.environ.get('ENGINE_T'), os.environ.get('PYTHONPATH'))",
    "exit_work": (
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('atexit'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()"
    ),
    "keyboard_interrupt": "import os, signal; os.kill(os.getpid(), signal.SIGINT)",
    "sigkill": "import os, signal; print('a', flush=True); os.kill(os.getpid(), signal.SIGKILL)",
}


def _same(a: subprocess.CompletedProcess, b: subprocess.CompletedProcess) -> None:
    assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_forked_python_answers_as_a_cold_one(name, tmp_path):
    args = [sys.executable, "-c", PROGRAMS[name], "a", "b"]
    env = {**os.environ, "ENGINE_T": "t"}
    env.pop("PYTHONPATH", None)
    kw = dict(capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    _same(_procs.run(args, **kw), subprocess.run(args, **kw))


def test_modules_scripts_pythonpath_and_stdin_as_a_cold_start(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "greet.py").write_text(
        "import sys\nif __name__ == '__main__':\n    print('hi', sys.argv[1:], sys.stdin.read())\n"
    )
    (tmp_path / "script.py").write_text("import sys, greet; print(sys.argv, sys.path[0])\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}
    kw = dict(capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    for args in ([sys.executable, "-m", "greet", "x"], [sys.executable, "script.py", "y"]):
        _same(_procs.run(args, input="in", **kw), subprocess.run(args, input="in", **kw))


def test_a_fork_is_fast_a_new_process_and_imported_torch_and_engine_already():
    start = time.monotonic()
    done = _procs.python(
        "-c", "import os, sys; print(os.getpid(), 'engine' in sys.modules, 'torch' in sys.modules)"
    )
    pid, engine, torch = done.stdout.split()
    assert int(pid) != os.getpid() and (engine, torch) == ("True", "True")
    assert time.monotonic() - start < 30  # a cold start takes 3-5 s; a fork well under one


def test_popen_streams_kills_and_times_out():
    code = "import time; print('ready', flush=True); time.sleep(60)"
    p = _procs.Popen([sys.executable, "-c", code], stdout=_procs.PIPE, text=True)
    assert p.stdout.readline() == "ready\n" and p.poll() is None
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == -signal.SIGTERM
    p.stdout.close()
    with pytest.raises(subprocess.TimeoutExpired):
        _procs.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)


def test_the_thread_count_follows_omp_num_threads():
    code = "import torch; print(torch.get_num_threads())"
    for n in ("1", "2"):
        env = {**os.environ, "OMP_NUM_THREADS": n}
        assert _procs.python("-c", code, env=env).stdout == f"{n}\n"


def test_what_a_fork_cannot_take_starts_cold():
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    p = _procs.Popen([sys.executable, "-c", "pass"], env=env)
    assert isinstance(p, subprocess.Popen) and p.wait(60) == 0
    p = _procs.Popen([sys.executable, "-X", "dev", "-c", "pass"])
    assert isinstance(p, subprocess.Popen) and p.wait(60) == 0
    p = _procs.Popen(["true"])
    assert isinstance(p, subprocess.Popen) and p.wait(60) == 0


@pytest.mark.parametrize("disposition", ["ignored", "default"])
def test_the_callers_ignored_signals_stay_ignored_as_through_exec(disposition):
    code = "import os, signal; os.kill(os.getpid(), signal.SIGINT); print('alive')"
    args = [sys.executable, "-c", code]
    before = signal.signal(
        signal.SIGINT, signal.SIG_IGN if disposition == "ignored" else signal.default_int_handler
    )
    try:
        kw = dict(capture_output=True, text=True, timeout=60)
        forked, cold = _procs.run(args, **kw), subprocess.run(args, **kw)
    finally:
        signal.signal(signal.SIGINT, before)
    assert forked.returncode == cold.returncode == (0 if disposition == "ignored" else -2)
    assert forked.stdout == cold.stdout


def _abort_on_rank_1(rank: int) -> int:
    if rank == 1:
        os.abort()  # as glibc does on a corrupted heap ("free(): invalid size")
    return rank


def test_a_rank_killed_by_a_fatal_signal_leaves_its_python_stack(capfd, tmp_path):
    from _ranks import run_ranks, torchrun

    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] died"):
        run_ranks(_abort_on_rank_1, 2, timeout=60)
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "_abort_on_rank_1" in err, err
    script = tmp_path / "abort.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    os.abort()\n")
    done = torchrun([script], 2, timeout=60)
    assert done.returncode == 1 and "Fatal Python error: Aborted" in done.stderr, done
