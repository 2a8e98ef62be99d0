"""Training over several processes on ``torch.distributed``: the strategies, the environments
that say who each process is, and the launchers that start them.

* :class:`DDP`: data parallel (every rank holds the whole state; the gradients are averaged
  once per optimizer step). A :class:`~engine.transforms.Strategy`, composed like any transform.
* :class:`FSDP`: fully sharded (each rank holds ``1/W`` of every parameter, gradient and
  optimizer leaf as DTensors; parameters gathered per unit inside the forward);
  :func:`full_state` gathers a sharded state whole.
* :class:`DeepSpeedStrategy`: DeepSpeed's ZeRO stages and config run as their FSDP2
  equivalents (Lightning's ``strategy="deepspeed_stage_*"`` names).
* :class:`SyncBatchNorm` / :func:`convert_sync_batchnorm`: batch norm with the statistics of
  every rank's batch, on the CPU too (``DDP(sync_batchnorm=True)`` converts a model's).
* :class:`CollectiveError`: one of engine's collectives failed (a rank did not join it within
  the strategy's ``timeout``, or died); it names the collective and the ranks.

A sharded state's checkpoints are this package's too: importing it registers their layout with
:mod:`engine.checkpoint` (``torch.distributed.checkpoint``'s IO, ``_dcp.py``, ``_dcp_layout.py``).
"""

from engine.errors import CollectiveError
from engine.parallel._dcp_layout import register as _register_checkpoint_layout
from engine.parallel._watchdog import signalled as signalled  # the driver's signal handler
from engine.parallel.ddp import DDP
from engine.parallel.deepspeed import DeepSpeedStrategy
from engine.parallel.fsdp import FSDP, full_state
from engine.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from engine.transforms.base import Strategy
from engine.transforms.common import SingleProcess

__all__ = [
    "DDP",
    "CollectiveError",
    "DeepSpeedStrategy",
    "FSDP",
    "SingleProcess",
    "Strategy",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "full_state",
]

_register_checkpoint_layout()  # checkpoint.save / load of a sharded state, and inspect
