"""The driver's pieces that are values and pure functions, and the loops over them.

* :class:`LoopConfig`: the Trainer's flags, resolved once into a frozen record
  (``config.py``); :func:`engine.loop.flags.resolve` checks the flags and builds it.
* :class:`Phase` / :class:`Progress`: where the fit loop is, as a checkpoint records it.
* :mod:`engine.loop.schedule`: when to validate and when to stop, as pure predicates that the
  Trainer and the listeners share.
* :func:`engine.loop.fit.fit`: the fit loop, a fold over local ``state`` and ``progress``
  values that reaches the Trainer through :class:`engine.loop.fit.FitServices`;
  :mod:`engine.loop.evaluate`: the evaluation loops (validation, test, the sanity check,
  prediction), the same kind of fold over :class:`engine.loop.evaluate.EvalServices`.

This face imports only the values and the schedule, which the listeners read: the flag
resolution (``flags.py``, over the driver's checks in ``engine._config``) and the loops are
imported from their modules, by the Trainer.
"""

from engine.loop import schedule
from engine.loop.config import LoopConfig
from engine.loop.progress import Phase, Progress

__all__ = ["LoopConfig", "Phase", "Progress", "schedule"]
