"""Replay: re-execute a stretch of a journaled run and check it, bitwise, against its journal.

A fit leaves a run directory (see :class:`engine.listeners.Journal`): the journal's lines (loss,
learning rate and state fingerprints at known steps), checkpoints, and the task, the model's
structure and the data pickled with cloudpickle. :func:`replay` loads the newest checkpoint taken
before step ``from_step``, runs the optimizer steps up to ``to_step`` again, and compares every
journaled value on the way: the loss of every step (a journal line's ``losses``), and the loss,
learning rate and fingerprint at the steps of the lines. Steps are numbered as in the journal:
the line ``"step": n`` is written after the ``n``-th optimizer step, so replaying
``from_step=n`` re-executes that step.

A journal that holds every step's loss pins a divergence to its step. One without (written by an
engine before ``losses``) pins it to an interval: the first differing value was seen at a line's
step, and the steps since the last value that matched hold no journaled value
(:attr:`ReplayReport.diverged_after`). A fingerprint that differs after every loss matched is
placed after the last fingerprint that matched, and the report says the losses matched.

Replay believes nothing it has not checked: every journal line is validated (a malformed one is
refused by line number), each fit's lines must lie between its start and end lines, the
checkpoint it starts from must hold the state its journal line describes (step and fingerprint:
a reused name such as ``last`` holds a later state, and an older checkpoint is taken instead),
every journaled value of the replayed steps is compared or reported, and pickled code is read
only from files inside the run directory.

The typical use is a loss that turned NaN: the journal shows roughly where, a replay of that
stretch names the first step with a non-finite loss, and replaying exactly that step with
``detect_anomaly=True`` reports the backward function that produced the NaN and the forward line
that called it (see docs/checkpoints.md).

The package, bottom up (each module imports only those above it in this list):

- ``_report``: :class:`ReplayReport`, :class:`Divergence`, :class:`ReplayError`,
  :class:`UntrustedCodeError`, and the checker's internal signals.
- ``_journal``: the journal read and checked line by line, positions, the run's own files, and
  the journaled checkpoints a replay may start from.
- ``_transitions``: the run's state transitions, applied again where they were applied.
- ``_checker``: the listener that compares the replayed fit with the journal.
- ``_loading``: the recorded run loaded (task, model structure, data, the flags that matter).
- ``_rerun``: :func:`replay` itself, and the re-execution, on the run's ranks where it had many.

The package is ``engine.replaying``, not ``engine.replay``: ``engine.replay`` is the function
(public API, in ``engine.__all__``), and a subpackage of that name would be shadowed by it, or
shadow it, depending on import order. Import the public names from :mod:`engine` (or from here).
"""

from engine.replaying._report import Divergence, ReplayError, ReplayReport, UntrustedCodeError
from engine.replaying._rerun import replay

__all__ = [
    "Divergence",
    "ReplayError",
    "ReplayReport",
    "UntrustedCodeError",
    "replay",
]
