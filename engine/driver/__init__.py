"""The driver: what runs a Trainer's calls, below its facade (``engine/trainer.py``).

* ``resolve.py``: the flags (:class:`~engine.plan.flags.Flags`) checked (``_checks.py``) and
  resolved once into a :class:`~engine.plan.LoopConfig`.
* ``assembly.py``: what the flags and plugins assemble once (the transforms of each slot, the
  strategy, the checkpoint IO; the default listeners and loggers), and each run's pipeline.
* ``run.py``: :class:`~engine.driver.run.Run`, the one owner of a call's mutable record (state
  and progress as last handed over, metrics, the listeners' view, the emitter, the
  checkpointer, the world's collectives); events and their requests go through it.
* ``services.py``: the loops' services over a Run (``engine.loop``'s protocols).
* ``fitting.py``, ``evaluating.py``: the stages, each top to bottom; ``context.py``: what
  surrounds every stage; ``restore.py``: a run continued from a checkpoint;
  ``directories.py``: the directories a fit checks and claims.
* ``checkpointer.py``: checkpoints written, resolved and restored for a run's listeners;
  ``_signals.py``: SIGTERM / SIGINT during a fit; ``_profiling.py``: the simple profiler;
  ``_views.py``: the Trainer's read-only attributes.

Nothing here is imported by the layers below (the listeners, the loops, the values).
"""
