"""The driver's pieces that are values and pure functions (the fit loop itself is the
Trainer's, for now).

* :func:`resolve` / :class:`LoopConfig`: the Trainer's flags, checked and resolved once into a
  frozen record (``flags.py`` / ``config.py``).
* :class:`Phase`: where the fit loop is, as a checkpoint records it.
* :mod:`engine.loop.schedule`: when to validate and when to stop, as pure predicates that the
  Trainer and the listeners share.
"""

from engine.loop import schedule
from engine.loop.config import LoopConfig
from engine.loop.flags import resolve
from engine.loop.progress import Phase

__all__ = ["LoopConfig", "Phase", "resolve", "schedule"]
