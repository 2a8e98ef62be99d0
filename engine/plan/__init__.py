"""What a run is to do and where it is: values and pure predicates that the loops, the
listeners and the driver share, below all three.

* ``config.py``: :class:`LoopConfig`, the Trainer's flags resolved once into a frozen record
  (the driver resolves them: :func:`engine.driver.resolve.resolve`).
* ``flags.py``: the flag table, the Trainer's flags with their defaults as given, once.
* ``progress.py``: :class:`Phase` / :class:`Progress`, where the fit loop is, as a checkpoint
  records it.
* ``schedule.py``: when to validate, save and stop, as pure predicates of the config and the
  counters.
* ``_duration.py``: ``max_time``'s forms, parsed (the flag checks and the Timer share it).

Nothing here imports the loops, the listeners or the driver.
"""

from engine.plan import schedule
from engine.plan.config import LoopConfig
from engine.plan.progress import Phase, Progress

__all__ = ["LoopConfig", "Phase", "Progress", "schedule"]
