"""``ModelSummary`` and :func:`summarize`: a table of the model's layers and parameter counts.

The layout follows Lightning's model summary: one row per layer down to ``max_depth`` (index,
name, type, parameters), then the totals. Counts come from the :class:`~engine.TrainState`:
``state.params`` are the trainable parameters; frozen parameters (``requires_grad=False``, which
the state keeps with the buffers) are the non-trainable ones; buffers proper (BatchNorm's running
statistics, ...) are not parameters, but their bytes count in the size, as they are saved too.
A pure-function state (no module) gets one row per tensor.
"""

from __future__ import annotations

from typing import IO, Any

from torch import Tensor, nn

from engine.events import EventRecord, Listener
from engine.state import TrainState

__all__ = ["ModelSummary", "summarize"]

_UNITS = ("", "K", "M", "B", "T")


def _readable(n: int) -> str:
    """``1234 -> '1.2 K'``, ``123456 -> '123 K'``; at most three significant digits."""
    if n < 1000:
        return str(n)
    group = min((len(str(n)) - 1) // 3, len(_UNITS) - 1)
    value = n / 1000**group
    return f"{value:,.1f} {_UNITS[group]}" if value < 100 else f"{int(value):,d} {_UNITS[group]}"


def _modules(module: nn.Module, max_depth: int) -> list[tuple[str, nn.Module]]:
    if max_depth == 0:
        return []
    if max_depth == 1:
        return list(module.named_children())
    return [
        (name, m)
        for name, m in module.named_modules()
        if name and (max_depth < 0 or name.count(".") < max_depth)
    ]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    rule = "-" * (sum(widths) + 3 * (len(widths) - 1))

    def line(cells: list[str]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [line(header), rule, *(line(r) for r in rows), rule]


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def summarize(state: TrainState, max_depth: int = 1) -> str:
    """The summary table of ``state``'s model, as text.

    Args:
        state: the state to describe; its ``module`` gives the layers, its tensors the counts.
        max_depth: how deep to list nested layers: 1 lists the top-level children, -1 lists
            every layer, 0 lists none (totals only).

    Raises:
        ValueError: if ``max_depth`` is not an int >= -1.
        TypeError: if ``state`` is not a TrainState.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import optim
        >>> from engine.listeners import summarize
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(),
        ...                             torch.nn.Linear(4, 2))
        >>> model[2].bias.requires_grad_(False)  # doctest: +ELLIPSIS
        Parameter containing: ...
        >>> print(summarize(eg.TrainState.create(model, optim.sgd(0.1))))
          | Name | Type   | Params
        --------------------------
        0 | 0    | Linear | 16
        1 | 1    | ReLU   | 0
        2 | 2    | Linear | 10
        --------------------------
        24        Trainable params
        2         Non-trainable params
        26        Total params
        0.000     Total size (MB), parameters and buffers
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"summarize() takes a TrainState (got {type(state).__name__})")
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
        raise ValueError(
            f"max_depth must be an int >= -1 (got {max_depth!r}): -1 lists every layer, "
            "0 none, n the layers up to n levels deep"
        )
    module = state.module
    if module is not None:
        param_names = {name for name, _ in module.named_parameters()}
        frozen = {k: v for k, v in state.buffers.items() if k in param_names}
        header = [" ", "Name", "Type", "Params"]
        rows = [
            [str(i), name, type(m).__name__, _readable(sum(p.numel() for p in m.parameters()))]
            for i, (name, m) in enumerate(_modules(module, max_depth))
        ]
    else:
        frozen = {}
        header = [" ", "Name", "Type", "Shape", "Params"]
        tensors = [(k, "Parameter", t) for k, t in state.params.items()]
        tensors += [(k, "Buffer", t) for k, t in state.buffers.items()]
        rows = [
            [
                str(i),
                name,
                kind,
                str(list(t.shape)),
                _readable(t.numel() if kind == "Parameter" else 0),
            ]
            for i, (name, kind, t) in enumerate(tensors if max_depth else [])
        ]
    trainable = sum(t.numel() for t in state.params.values())
    non_trainable = sum(t.numel() for t in frozen.values())
    size_mb = sum(_nbytes(t) for t in (*state.params.values(), *state.buffers.values())) / 1e6
    lines = _table(header, rows) if rows else []
    lines += [
        f"{_readable(trainable):<10}Trainable params",
        f"{_readable(non_trainable):<10}Non-trainable params",
        f"{_readable(trainable + non_trainable):<10}Total params",
        f"{size_mb:<10,.3f}Total size (MB), parameters and buffers",
    ]
    return "\n".join(lines)


class ModelSummary(Listener):
    """Print :func:`summarize` of the state when fitting starts.

    Args:
        max_depth: how deep to list nested layers (1: top-level children, -1: all); 0 turns
            the summary off.
        file: where to print (default ``sys.stdout``).

    Raises:
        ValueError: if ``max_depth`` is not an int >= -1.

    Example:
        >>> import torch
        >>> import engine as eg
        >>> from engine import optim
        >>> from engine.events import Event, EventRecord
        >>> from engine.listeners import ModelSummary
        >>> state = eg.TrainState.create(torch.nn.Linear(3, 2), optim.sgd(0.1))
        >>> rec = EventRecord(Event.ON_FIT_START, "fit", state, {})
        >>> ModelSummary(max_depth=1).on_fit_start(rec)  # a Linear has no children: totals
        8         Trainable params
        0         Non-trainable params
        8         Total params
        0.000     Total size (MB), parameters and buffers
    """

    may_stop = False  # it never returns Stop (see Listener.may_stop)

    rank_zero_only = True  # its output is the run's, written once

    def __init__(self, max_depth: int = 1, *, file: IO[str] | None = None) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise ValueError(
                f"max_depth must be an int >= -1 (got {max_depth!r}); 0 turns the summary off"
            )
        self.max_depth = max_depth
        self.file = file

    def on_fit_start(self, rec: EventRecord) -> None:
        """Print the summary of the state being fitted."""
        if self.max_depth == 0:
            return
        if rec.state is None:
            return
        print(summarize(rec.state, self.max_depth), file=self.file)

    def __getstate__(self) -> dict[str, Any]:
        return {**vars(self), "file": None}  # a file handle does not pickle
