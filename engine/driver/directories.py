"""The directories a fit writes: checked before any work (:func:`check`), claimed once the
fit's flags and data have been checked (:func:`claim`), rank 0's names on every rank."""

from __future__ import annotations

import os

from engine.checkpoint._writable import check_writable
from engine.driver.assembly import is_a
from engine.driver.run import Run

__all__ = ["check", "claim"]


def check(run: Run) -> None:
    """Check that every directory the run writes can be written (each named with the flag that
    set it). The directories are what the loggers and listeners say (``log_dir``,
    ``dirpath``), and ``default_root_dir`` when any of them may write under it. Nothing is
    created (see :func:`claim`)."""
    found: list[tuple[str, str]] = []
    for lg in run.loggers:
        if getattr(lg, "log_dir", None):
            where = getattr(lg, "save_dir", lg.log_dir)
            found.append((str(lg.log_dir), f"{type(lg).__name__}(save_dir={where!r})"))
    for listener in run.callbacks:
        if getattr(listener, "dirpath", None) is not None:
            flag = f"{type(listener).__name__}(dirpath={os.fspath(listener.dirpath)!r})"
            found.append((os.fspath(listener.dirpath), flag))
    if run.loggers or any(hasattr(x, "dirpath") for x in run.callbacks):
        root = run.config.default_root_dir
        found.insert(0, (root, f"Trainer(default_root_dir={root!r})"))
    check_writable(found)


def claim(run: Run) -> None:
    """Claim the loggers' run directories (``claim()``: a version another process took
    meanwhile is not shared), before the listeners read ``log_dir``; on several ranks, every
    rank names rank 0's directories, the journal's too."""
    zero = run.is_global_zero
    if zero:
        for lg in run.loggers:
            if callable(getattr(lg, "claim", None)):
                lg.claim()
    if run.world_size > 1:
        # only a logger that adopts a version is asked for one: reading an MLFlowLogger's
        # starts its run (Lightning's property), which a resumed fit continues instead
        versions = run.broadcast(
            [
                getattr(lg, "version", None) if callable(getattr(lg, "adopt", None)) else None
                for lg in run.loggers
            ]
        )
        for lg, version in zip(run.loggers, versions, strict=True):
            adopt = getattr(lg, "adopt", None)
            if callable(adopt) and not zero:
                adopt(version)
        # the journal's run directory too (the first logger's, or one rank 0 claims): the
        # other ranks follow its journal, and join the save of its start checkpoint
        journals = [x for x in run.callbacks if is_a(x, "Journal")]
        root = run.config.default_root_dir
        claimed = [j.claim(run.loggers, root) if zero else None for j in journals]
        for journal, path in zip(journals, run.broadcast(claimed), strict=True):
            journal.adopt(path)
