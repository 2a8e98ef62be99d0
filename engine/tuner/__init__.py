"""The tuner: Lightning's ``Tuner`` over engine's Trainer.

:class:`Tuner` searches from outside a fit: ``lr_find`` (a learning-rate range test) and
``scale_batch_size`` (the largest batch size that fits in memory), each as trial fits on the
Trainer's flags, from a copy of the state given. The searches themselves, and the listeners
that run them when a fit starts (:class:`~engine.listeners.LearningRateFinder`,
:class:`~engine.listeners.BatchSizeFinder`), live in :mod:`engine.listeners`; this package adds
the facade, which reads the Trainer.

======================  ==================================================================
``tuning``              :class:`Tuner`: its checks, the loaders, the searches run
======================  ==================================================================
"""

from engine.listeners.lr_finder import LRFinderResult
from engine.tuner.tuning import Tuner

__all__ = ["LRFinderResult", "Tuner"]
