"""The loops: folds over local ``state`` and ``progress`` values, for custom loops and for the
Trainer.

* :func:`engine.loop.fit.fit`: the fit loop, reaching its driver through
  :class:`engine.loop.fit.FitServices`;
* :mod:`engine.loop.evaluate`: the evaluation loops (validation, test, the sanity check,
  prediction), the same kind of fold over :class:`engine.loop.evaluate.EvalServices`;
* ``services.py``: what every loop asks of its driver.

The values they read (:class:`LoopConfig`, :class:`Phase`, :class:`Progress`, the
:mod:`~engine.plan.schedule`) live in :mod:`engine.plan`, below the loops and the listeners
both, and are re-exported here.
"""

from engine.plan import LoopConfig, Phase, Progress, schedule

__all__ = ["LoopConfig", "Phase", "Progress", "schedule"]
