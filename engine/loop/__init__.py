"""The driver's pieces that are values and pure functions, and the fit loop over them.

* :func:`resolve` / :class:`LoopConfig`: the Trainer's flags, checked and resolved once into a
  frozen record (``flags.py`` / ``config.py``).
* :class:`Phase` / :class:`Progress`: where the fit loop is, as a checkpoint records it.
* :func:`engine.loop.fit.fit`: the fit loop, a fold over local ``state`` and ``progress``
  values that reaches the Trainer through :class:`engine.loop.fit.FitServices`.
* :mod:`engine.loop.schedule`: when to validate and when to stop, as pure predicates that the
  Trainer and the listeners share.
"""

from engine.loop import schedule
from engine.loop.config import LoopConfig
from engine.loop.flags import resolve
from engine.loop.progress import Phase, Progress

__all__ = ["LoopConfig", "Phase", "Progress", "resolve", "schedule"]
