"""The Trainer's simple and PyTorch profilers (a mixin of :class:`engine.trainer.Trainer`)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

__all__: list[str] = []


class ProfilingMixin:
    """``profiler="simple"``: per-action timings; ``"pytorch"``: a Chrome trace in the log dir."""

    profiler: str | None
    profile: dict[str, list[float]]
    default_root_dir: str

    if TYPE_CHECKING:  # provided by the Trainer

        @property
        def log_dir(self) -> str | None: ...

    @contextlib.contextmanager
    def _profiler(self, stage: str) -> Iterator[None]:
        if self.profiler is None:
            yield
            return
        log_dir = self.log_dir or self.default_root_dir
        os.makedirs(log_dir, exist_ok=True)
        if self.profiler == "pytorch":
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

    def _timed(self, action: str, fn: Any) -> Any:
        """``fn``, timed into ``self.profile[action]`` when ``profiler="simple"``, else itself
        (no cost in the loop when profiling is off)."""
        if self.profiler != "simple":
            return fn

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.profile.setdefault(action, []).append(time.perf_counter() - t0)

        return timed
