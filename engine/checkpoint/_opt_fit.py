"""Whether a checkpoint's optimizer state fits the optimizer it is loaded for, and why not.

A resume continues the optimizer a checkpoint was saved with: its state (Adam's moments, SGD's
momentum buffer) is loaded into the state the task's optimizer builds, which must have the same
form. When it does not (an AdamW checkpoint, an SGD task), :class:`OptimizerMismatch` says which
optimizer the state came from (the Trainer records its name in ``meta.json``'s
``extra["optimizer"]``; older checkpoints and ``checkpoint.save`` calls without it are named by
what their state holds), what the task's holds, and what to do: build the task with the saved
optimizer, or give a new optimizer the checkpoint's weights alone.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError
from engine.optim.base import GradientTransformation, state_dict

__all__ = ["EXTRA_KEY", "OptimizerMismatch", "loading", "name_of", "refuse", "saved_name"]

#: ``meta.json``'s ``extra[EXTRA_KEY]``: the name of the optimizer that made the state
EXTRA_KEY = "optimizer"

_FIELD = re.compile(r"\.([A-Za-z_]\w*)")  # "[0].exp_avg['w']" -> exp_avg
_INDEX = re.compile(r"\[(?:'[^']*'|\"[^\"]*\"|[^\]]*)\]")  # [0], ['0.weight']: not fields


def name_of(tx: GradientTransformation) -> str | None:
    """The optimizer's name (``"AdamW"``, ``"SGD"``; a recipe's name for one without a
    ``torch.optim`` counterpart), ``None`` for an unnamed chain."""
    if tx.name:
        return tx.name
    return tx.recipe.name if tx.recipe is not None else None


def saved_name(meta: Mapping[str, Any]) -> str | None:
    """The name of the optimizer a checkpoint's state came from, if it was recorded."""
    name = (meta.get("extra") or {}).get(EXTRA_KEY)
    return name if isinstance(name, str) and name else None


def _holds(keys: Iterable[str]) -> str:
    """What a state with these state-dict keys holds, in words: its fields, in order."""
    keys = list(keys)
    if not keys:
        return "nothing (an optimizer without state, such as SGD without momentum)"
    fields = list(dict.fromkeys(m for k in keys for m in _FIELD.findall(_INDEX.sub("", k))))
    if fields:
        return ", ".join(fields)
    return f"{len(keys)} values ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"


class OptimizerMismatch(CheckpointError):
    """A checkpoint's optimizer state does not fit the optimizer it is loaded for.

    Attributes:
        path: the checkpoint.
        saved: the name of the optimizer the state came from (``None``: not recorded).
        task: the name of the optimizer it was loaded for (``None``: only its state known).
    """

    def __init__(
        self,
        path: Path,
        saved: str | None,
        saved_keys: Iterable[str],
        template: Any,
        detail: str | None,
        task: str | None = None,
    ) -> None:
        self.path, self.saved, self.task = path, saved, task
        self._saved_keys, self._template, self._detail = list(saved_keys), template, detail
        ours = list(state_dict(template))
        came = f"was saved by {saved} and holds" if saved else "holds"
        theirs = f"the task's optimizer, {task}," if task else "the template's optimizer state"
        if saved and task and saved == task:
            build = f"{saved} with the settings it was saved with (its momentum, say)"
        else:
            build = f"the task with {saved or 'the optimizer it was saved with'}"
        super().__init__(
            f"{path}: its optimizer state {came} {_holds(self._saved_keys)}; {theirs} holds "
            f"{_holds(ours)}{f' ({detail})' if detail else ''}: it cannot continue from that "
            f"state. A resume continues the optimizer it was saved with: build {build}. To give "
            "a new optimizer the checkpoint's weights alone: checkpoint.load_weights(path, "
            "model), then state = task.init(model) and fit without ckpt_path"
        )

    def for_task(self, task: str | None) -> OptimizerMismatch:
        """The same refusal naming the optimizer the task builds."""
        return OptimizerMismatch(
            self.path, self.saved, self._saved_keys, self._template, self._detail, task
        )


def refuse(
    path: Path, meta: Mapping[str, Any], template: Any, saved: Mapping[str, Any], error: Exception
) -> OptimizerMismatch:
    """The refusal of loading ``saved`` (a state dict) into ``template`` (an optimizer
    state), which raised ``error`` (``load_state_dict``'s ``KeyError`` or ``ValueError``)."""
    detail = None  # a KeyError's key lists: the fields each side holds say it in words
    if not isinstance(error, KeyError):  # a value of another shape or dtype
        detail = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
    return OptimizerMismatch(path, saved_name(meta), saved, template, detail)


@contextlib.contextmanager
def loading(path: Path, optimizer: Any, *, stage: str | None, asked: Any) -> Iterator[None]:
    """Around a Trainer's load of the checkpoint at ``path`` for a task built with ``optimizer``
    (``asked``: the ``ckpt_path`` given): a misfit names the task's optimizer; a fit that loads
    another optimizer's state of the same form (Adam's moments for AdamW) warns that it does."""
    task = name_of(optimizer) if isinstance(optimizer, GradientTransformation) else None
    try:
        yield
    except OptimizerMismatch as e:
        raise e.for_task(task) from e.__cause__
    if stage != "fit" or task is None:
        return
    try:  # verified by the load that just succeeded
        saved = saved_name(json.loads((path / "meta.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, AttributeError):
        return
    if saved and saved != task:
        warnings.warn(
            f"fit(ckpt_path={str(asked)!r}): {path} was saved with {saved}, the task builds "
            f"{task}: their states have the same form, so {task} continues from {saved}'s "
            "(a resume is exact only with the optimizer it was saved with)",
            stacklevel=5,
        )
