"""``Journal``: the run's record — configuration, the task's code, and a line per logged step.

A journal is what a replay checks itself against: JSON lines of ``step``, ``epoch``,
``batch_idx``, ``loss`` and ``lr``, plus the state's ``fingerprint`` every
``fingerprint_every_n_steps`` steps and at every checkpoint. Beside it, ``config.json`` (the
Trainer's flags) and ``task.pkl`` (the task's functions, pickled with cloudpickle so a run can
be re-executed without its script; loading it runs code, so replay asks for explicit trust).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import IO, Any

import torch

from engine.events import EventRecord, Listener

__all__ = ["Journal"]

JOURNAL, CONFIG, TASK = "journal.jsonl", "config.json", "task.pkl"


class Journal(Listener):
    """Write the run directory's journal while fitting.

    Args:
        dirpath: the run directory; default the trainer's ``log_dir``.
        every_n_steps: a line every this many optimizer steps (default: the trainer's
            ``log_every_n_steps``). Each line reads the loss on the host: one sync.
        fingerprint_every_n_steps: add the state's fingerprint (a hash of every byte of the
            state) every this many steps; ``0`` only at checkpoints.

    Example:
        >>> import tempfile, torch, torch.nn.functional as F
        >>> import engine as eg
        >>> from engine import optim
        >>> from engine.listeners import Journal
        >>> task = eg.Task(lambda m, b: F.mse_loss(m(b[0]), b[1]), optim.sgd(0.1))
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1))] * 4
        >>> d = tempfile.mkdtemp()
        >>> trainer = eg.Trainer(max_epochs=1, logger=False, enable_progress_bar=False,
        ...                      enable_model_summary=False, enable_checkpointing=False,
        ...                      callbacks=[Journal(d, every_n_steps=2)])
        >>> _ = trainer.fit(task, task.init(torch.nn.Linear(3, 1)), data)
        >>> [line["step"] for line in Journal.read(d)]
        [2, 4]
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        every_n_steps: int | None = None,
        fingerprint_every_n_steps: int = 100,
    ) -> None:
        for name, value in (
            ("every_n_steps", every_n_steps),
            ("fingerprint_every_n_steps", fingerprint_every_n_steps),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"Journal({name}={value!r}): pass an int >= 0")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.every_n_steps = every_n_steps
        self.fingerprint_every_n_steps = fingerprint_every_n_steps
        self._file: IO[str] | None = None
        self._last_step = -1

    # ------------------------------------------------------------------ events

    def on_fit_start(self, rec: EventRecord) -> None:
        trainer = rec.trainer
        root = self.dirpath or Path(trainer.log_dir or trainer.default_root_dir)
        root.mkdir(parents=True, exist_ok=True)
        self.dirpath = root
        if self.every_n_steps is None:
            self.every_n_steps = trainer.log_every_n_steps
        (root / CONFIG).write_text(json.dumps(_config(trainer), indent=2, sort_keys=True))
        self._save_task(trainer.task, root / TASK)
        self._file = open(root / JOURNAL, "a")  # noqa: SIM115 - open for the whole fit

    def on_train_batch_end(self, rec: EventRecord) -> None:
        state = rec.state
        if self._file is None or state is None or state.micro_step or not self.every_n_steps:
            return
        if state.step % self.every_n_steps or state.step == self._last_step:
            return
        fp_every = self.fingerprint_every_n_steps
        with_fp = bool(fp_every) and state.step % fp_every == 0
        self._write(rec, loss=rec.outputs.get("loss") if rec.outputs else None, fingerprint=with_fp)

    def on_save_checkpoint(self, rec: EventRecord) -> None:
        if self._file is not None and rec.state is not None:
            self._write(rec, loss=None, fingerprint=True, checkpoint=True)

    def on_train_end(self, rec: EventRecord) -> None:
        self._close()

    def on_exception(self, rec: EventRecord) -> None:
        self._close()

    # ------------------------------------------------------------------ writing and reading

    def _write(
        self, rec: EventRecord, *, loss: Any, fingerprint: bool, checkpoint: bool = False
    ) -> None:
        assert self._file is not None and rec.state is not None
        state = rec.state
        line: dict[str, Any] = {
            "step": state.step,
            "epoch": state.epoch,
            "batch_idx": state.batch_idx,
        }
        if loss is not None:
            line["loss"] = float(loss)  # the one host sync of a journal line
        lr = getattr(rec.trainer.task, "lr", None)
        if lr is not None:
            line["lr"] = float(lr(state.step) if callable(lr) else lr)
        if fingerprint:
            line["fingerprint"] = state.fingerprint()
        if checkpoint:
            line["checkpoint"] = True
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        self._last_step = state.step

    def _close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    @staticmethod
    def _save_task(task: Any, path: Path) -> None:
        try:
            import cloudpickle

            path.write_bytes(cloudpickle.dumps(task))
        except Exception as e:  # a task closing over something unpicklable
            warnings.warn(
                f"Journal: the task could not be pickled ({e}); the run cannot be replayed "
                "without its script",
                stacklevel=2,
            )

    @staticmethod
    def read(dirpath: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """The journal's lines, in order."""
        with open(Path(dirpath) / JOURNAL) as f:
            return [json.loads(line) for line in f if line.strip()]


def _config(trainer: Any) -> dict[str, Any]:
    keep = (int, float, str, bool, type(None))
    config = {
        k: v for k, v in vars(trainer).items() if not k.startswith("_") and isinstance(v, keep)
    }
    config["torch_version"] = torch.__version__
    return config
