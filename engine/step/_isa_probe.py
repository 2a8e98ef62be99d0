"""Inductor's CPU probe beside the trace (private): :func:`probe_cpu_in_background`.

The first CPU graph a process compiles with Inductor asks which vector instruction sets this
CPU runs. Inductor answers once a process (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``,
cached): for each candidate set it spawns a child process that ``dlopen``s a test library
linked against libtorch, ten children of ~0.13 s each on the machines we measure (x86 with
AVX-512 and AMX). It asks only after Dynamo has traced the step and AOTAutograd has split it,
so by default those ~1.3 s follow the trace, and were a quarter of a warm-cache compile of the
tiny benchmark's 8-step block.

The parent of each child only waits (the GIL released), so the probe costs the tracing thread
nothing if started in a thread of its own before the trace: by the time Inductor asks, the
answer is cached. The thread computes exactly what Inductor would (the same cached function,
the same config), so the compiled code is the same.

Left to Inductor: a process whose user passed ``cpp.vec_isa_ok`` in the compile's options
(applied only while Inductor compiles: a probe run before would read the global value and
cache the answer for the process), and any failure, which the thread swallows: Inductor asks
again and reports it itself.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any

__all__ = ["probe_cpu_in_background", "wants_probe"]

_NAME = "engine-inductor-cpu-probe"
_lock = threading.Lock()
_started = False


def wants_probe(options: Mapping[str, Any]) -> bool:
    """Whether a CPU graph compiled with these ``torch.compile`` arguments may have Inductor's
    probe run ahead: Inductor's backend, and no ``cpp.vec_isa_ok`` of the user's own."""
    if options.get("backend", "inductor") != "inductor":
        return False
    theirs = options.get("options") or {}
    cpp = theirs.get("cpp")
    return "cpp.vec_isa_ok" not in theirs and not (isinstance(cpp, Mapping) and "vec_isa_ok" in cpp)


def probe_cpu_in_background() -> None:
    """Start Inductor's once-a-process probe of this CPU in a thread (once; later calls return).

    The modules it needs are imported here, in the caller's thread (the compile imports them
    anyway), so the thread imports nothing while Dynamo's tracing imports in this one.
    """
    global _started
    with _lock:
        if _started:
            return
        _started = True
        try:
            import torch.utils.cpp_extension  # noqa: F401  (the probe's build options read it)
            from torch._inductor import codecache, cpp_builder, cpu_vec_isa  # noqa: F401
            from torch.utils import _filelock  # noqa: F401

            probe = cpu_vec_isa.valid_vec_isa_list
        except (ImportError, AttributeError):  # another torch: Inductor probes in its own time
            return
        # not a daemon: the children it waits on end within seconds, and a daemon thread
        # still running at interpreter exit can crash the exit
        threading.Thread(target=_quietly, args=(probe,), name=_NAME).start()


def _quietly(probe: Any) -> None:
    with contextlib.suppress(Exception):  # Inductor asks again, and reports it
        probe()
