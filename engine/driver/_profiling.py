"""The Trainer's simple and PyTorch profilers (``Trainer(profiler=...)``), as an object it holds."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__: list[str] = []


class Profiler:
    """``"simple"``: per-action timings, a table printed and written to the log directory;
    ``"pytorch"``: a Chrome trace there; ``None``: nothing, at no cost.

    Example:
        >>> import tempfile
        >>> p = Profiler("simple")
        >>> with tempfile.TemporaryDirectory() as d, p.run("fit", d):  # doctest: +ELLIPSIS
        ...     step = p.timed("train_step", lambda x: x + 1)
        ...     _ = [step(i) for i in range(3)]
        Simple profiler: fit took ...
        >>> len(p.profile["train_step"])
        3
    """

    def __init__(self, kind: str | None) -> None:
        self.kind = kind
        self.profile: dict[str, list[float]] = {}  # the last run's timings, by action

    @contextlib.contextmanager
    def run(self, stage: str, log_dir: str) -> Iterator[None]:
        """Profile one Trainer run (``stage``), writing what it found into ``log_dir``."""
        if self.kind is None:
            yield
            return
        os.makedirs(log_dir, exist_ok=True)
        if self.kind == "pytorch":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                yield
            path = os.path.join(log_dir, f"{stage}-trace.json")
            prof.export_chrome_trace(path)
            print(f"PyTorch profiler trace written to {path}")
            return
        start = time.perf_counter()
        self.profile = {}
        yield
        total = time.perf_counter() - start
        lines = [
            f"Simple profiler: {stage} took {total:.3f}s",
            "",
            f"{'action':24s} {'calls':>8s} {'total s':>10s} {'mean ms':>10s} {'% of run':>9s}",
        ]
        for action, times in sorted(self.profile.items(), key=lambda kv: -sum(kv[1])):
            spent = sum(times)
            lines.append(
                f"{action:24s} {len(times):8d} {spent:10.3f} {1e3 * spent / len(times):10.3f} "
                f"{100 * spent / total:8.1f}%"
            )
        report = "\n".join(lines)
        with open(os.path.join(log_dir, f"{stage}-profile.txt"), "w") as f:
            f.write(report + "\n")
        print(report)

    def timed(self, action: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, timed into ``profile[action]`` with the simple profiler, else ``fn`` itself
        (no cost in the loop when profiling is off)."""
        if self.kind != "simple":
            return fn

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.profile.setdefault(action, []).append(time.perf_counter() - t0)

        return timed
