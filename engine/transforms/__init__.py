"""Step transforms: how a step runs (device, precision, clipping, compilation), composed in one
declared order by :func:`compose`.

The Trainer's flags build a :class:`Pipeline`; a custom loop builds the same one and gets the
Trainer's results bitwise::

    pipeline = transforms.compose(clip=optim.clip_by_global_norm(1.0), accumulate=4)
    state = pipeline.prepare(state)
    step = pipeline.train_step(loss_fn, tx)
    for batch in loader:
        state, metrics = step(state, pipeline.move(batch))
"""

from engine.transforms.base import Strategy, Transform
from engine.transforms.common import (
    Clip,
    Compile,
    DetectAnomaly,
    Float32,
    SingleDevice,
    SingleProcess,
)
from engine.transforms.compose import Pipeline, compose
from engine.transforms.observe import Observe
from engine.transforms.precision import (
    PRECISIONS,
    DynamicLossScale,
    MixedPrecision,
    TransformerEngine,
    TruePrecision,
    canonical_precision,
    precision_transform,
)

__all__ = [
    "PRECISIONS",
    "Clip",
    "Compile",
    "DetectAnomaly",
    "DynamicLossScale",
    "Float32",
    "MixedPrecision",
    "Observe",
    "Pipeline",
    "SingleDevice",
    "SingleProcess",
    "Strategy",
    "Transform",
    "TransformerEngine",
    "TruePrecision",
    "canonical_precision",
    "compose",
    "precision_transform",
]
