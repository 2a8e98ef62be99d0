"""``ckpt_path="best"`` in a process whose ``ModelCheckpoint`` has ranked nothing (``engine test
--ckpt_path best`` after ``engine fit``, a script run again): the best checkpoint of the run,
found from what is on disk.

Each checkpoint a fit writes carries its ``ModelCheckpoint``'s state (``extra.listeners``):
the monitor, and ``best_model_path`` as of that save. The newest checkpoint that verifies, in
the directories a run's ``ModelCheckpoint`` saves to, therefore names the run's best. Where
that cannot be found, the error says exactly what was searched and what was missing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engine import checkpoint

__all__ = ["best_on_disk", "recency", "search_roots"]


def recency(path: Path) -> tuple[int, int, float]:
    """Newest first: the step, then when the checkpoint says it was saved (nanoseconds: two
    checkpoints of one step are milliseconds apart), then the directory's mtime. Raises
    ``CheckpointError`` when its ``meta.json`` fails verification."""
    meta = checkpoint.read_meta(path)
    saved_ns = meta["extra"].get("trainer", {}).get("saved_at_ns", -1)
    return meta["step"], saved_ns if isinstance(saved_ns, int) else -1, path.stat().st_mtime


def search_roots(savers: Iterable[Any], root: str, loggers: Iterable[Any]) -> list[Path]:
    """Where a run's checkpoints may be: each ``ModelCheckpoint``'s ``dirpath`` (as given or
    resolved), ``<root>/checkpoints``, and the ``checkpoints`` directory of every version of
    the loggers' experiments and of ``<root>/lightning_logs`` (a new process has a new
    version: the fit's is an earlier one)."""
    roots = [Path(x.dirpath) for x in savers if getattr(x, "dirpath", None)]
    roots.append(Path(root) / "checkpoints")
    experiments = [Path(root) / "lightning_logs"]
    for lg in loggers:
        save_dir = getattr(lg, "save_dir", None)
        if save_dir is not None:
            experiments.append(Path(save_dir) / (getattr(lg, "name", None) or ""))
    for experiment in dict.fromkeys(experiments):
        try:
            versions = sorted(p for p in experiment.iterdir() if p.is_dir())
        except OSError:  # not there (yet): nothing saved under it
            continue
        roots.extend(v / "checkpoints" for v in versions)
    return list(dict.fromkeys(roots))


def best_on_disk(roots: list[Path]) -> Path:
    """The best checkpoint the newest verified checkpoint in ``roots`` records (its
    ``ModelCheckpoint``'s ``best_model_path``).

    Raises:
        ValueError: saying what was searched and why no best checkpoint is known: no
            checkpoint there, none that verifies, no ``ModelCheckpoint`` with a monitor in the
            newest, or a best checkpoint that is gone.
    """
    found: list[tuple[tuple[int, int, float], Path]] = []
    for root in roots:
        try:
            entries = list(root.iterdir()) if root.is_dir() else []
        except OSError:
            continue
        for p in entries:
            try:
                if (p / checkpoint.META).is_file():
                    found.append((recency(p), p))
            except (checkpoint.CheckpointError, OSError, KeyError, TypeError):
                continue  # unreadable: not a candidate
    searched = ", ".join(str(r) for r in roots)
    if not found:
        raise ValueError(
            f'ckpt_path="best": no ModelCheckpoint of this process has ranked a checkpoint, and '
            f"no checkpoint is on disk in {searched}; pass the run's checkpoint directory as "
            "ModelCheckpoint(dirpath=...) or trainer.default_root_dir, or a path"
        )
    for _, newest in sorted(found, key=lambda x: x[0], reverse=True):
        try:
            checkpoint.verify(newest)
        except (checkpoint.CheckpointError, OSError):
            continue
        states = checkpoint.read_meta(newest).get("extra", {}).get("listeners", {})
        savers = [
            s
            for key, s in states.items()
            if key.startswith("ModelCheckpoint")
            and isinstance(s, dict)
            and s.get("best_model_path")
        ]
        # a monitored one's best first; without a monitor, as in Lightning, its latest save
        ranked = sorted(savers, key=lambda s: not s.get("monitor"))
        if not ranked:
            raise ValueError(
                f'ckpt_path="best": the newest checkpoint, {newest}, records no ModelCheckpoint '
                "that named a best checkpoint (it was not saved by one); pass a path, or "
                'ckpt_path="last"'
            )
        best = ranked[0]["best_model_path"]
        path = Path(best)
        if not path.is_absolute():
            path = newest.parent / path
        if not (path / checkpoint.META).is_file():
            raise ValueError(
                f'ckpt_path="best": the newest checkpoint, {newest}, names {best} as its run\'s '
                f"best (monitor {ranked[0].get('monitor')!r}), which is not on disk any more"
            )
        return Path(os.path.normpath(path))
    raise ValueError(
        f'ckpt_path="best": no checkpoint in {searched} verifies (each is damaged or '
        "incomplete); pass a path"
    )
