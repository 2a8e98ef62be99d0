"""Batch norm whose training statistics are those of every rank's batch together, on any device.

``torch.nn.SyncBatchNorm`` computes them on CUDA only (on a CPU tensor its forward raises
"SyncBatchNorm expected input tensor to be on GPU"), so data parallel training on gloo needs its
own: :class:`SyncBatchNorm` here. In training each rank sums its batch per channel (the sum, the
sum of squares and the count), ONE differentiable all-reduce adds the ranks' sums (its backward
all-reduces the gradients, so every rank's loss reaches every rank's inputs through the shared
statistics), and the global mean and biased variance normalise the batch; the running statistics
are updated with the global mean and the unbiased global variance exactly as ``nn.BatchNorm*d``
updates them (``momentum``, ``num_batches_tracked``, ``momentum=None`` a cumulative average). In
eval mode (or outside a process group of more than one rank) it is ``nn.BatchNorm*d``.

Its parameters and buffers have ``nn.BatchNorm*d``'s names (``weight``, ``bias``,
``running_mean``, ``running_var``, ``num_batches_tracked``), so a state's keys and checkpoints do
not change when :func:`convert_sync_batchnorm` replaces a model's batch norms.

The variance is ``E[x^2] - E[x]^2`` of float32 sums (float32 also for half-precision inputs):
exact enough where a channel's mean is not many standard deviations away from 0 (a 2-rank run
matches one process on the whole batch to 1e-6 after 20 AdamW steps in the tests).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class SyncBatchNorm(_BatchNorm):
    """``nn.BatchNorm*d`` with the statistics of every rank's batch in training, on any device.

    Takes an input of any rank ``>= 2`` (``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)``, ...), as
    ``torch.nn.SyncBatchNorm`` does.

    Args:
        num_features: ``C``, the channels.
        eps, momentum, affine, track_running_stats: as ``nn.BatchNorm1d``'s.
        process_group: the ranks whose batches make the statistics (default: all of them).

    Example:
        >>> import torch
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> x = torch.randn(8, 3, 4, 4)
        >>> sync, plain = SyncBatchNorm(3), torch.nn.BatchNorm2d(3)
        >>> torch.equal(sync(x), plain(x))  # one process: nn.BatchNorm2d, bit for bit
        True
        >>> torch.equal(sync.running_var, plain.running_var)
        True
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects an input of shape (N, C, ...), with 2 or more "
                f"dimensions (got {input.dim()}: {tuple(input.shape)})"
            )

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) got an input with {input.shape[1]} "
                f"channels (shape {tuple(input.shape)}): build it with num_features="
                f"{input.shape[1]}"
            )
        # as nn.BatchNorm*d: the factor of the running average, num_batches_tracked counted
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        group = self.process_group
        if not (self.training and batch_stats and _world(group) > 1):
            tracked = not self.training or self.track_running_stats
            return F.batch_norm(
                input,
                self.running_mean if tracked else None,
                self.running_var if tracked else None,
                self.weight,
                self.bias,
                batch_stats,
                factor,
                self.eps,
            )
        return self._synced(input, factor, group)

    def _synced(self, input: Tensor, factor: float, group: Any) -> Tensor:
        c = self.num_features
        dims = [0, *range(2, input.dim())]
        shape = [1, c] + [1] * (input.dim() - 2)
        x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        count = torch.full((1,), input.numel() // c, dtype=x.dtype, device=x.device)
        # ONE collective: this rank's per-channel sum and sum of squares, and its count
        local = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        total = _all_reduce_sum(local, group)
        n = total[2 * c]
        mean = total[:c] / n
        var = (total[c : 2 * c] / n - mean * mean).clamp_min(0.0)  # biased, as normalised
        out = (x - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape)
        if self.bias is not None:
            out = out + self.bias.view(shape)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():  # nn.BatchNorm's update: the unbiased variance, momentum
                unbiased = var * (n / (n - 1).clamp_min(1.0))
                rm, rv = self.running_mean, self.running_var
                if rv is not None:  # both are tracked, or neither
                    rm.copy_(factor * mean.to(rm.dtype) + (1.0 - factor) * rm)
                    rv.copy_(factor * unbiased.to(rv.dtype) + (1.0 - factor) * rv)
        return out.to(input.dtype)

    @classmethod
    def from_batchnorm(cls, bn: _BatchNorm, process_group: Any = None) -> SyncBatchNorm:
        """A synced batch norm holding ``bn``'s own parameter and buffer tensors (shared, not
        copied), in ``bn``'s training mode."""
        new = cls(
            bn.num_features,
            bn.eps,
            bn.momentum,
            bn.affine,
            bn.track_running_stats,
            process_group=process_group,
        )
        # the same tensor objects: a state borrowing them keeps them; no memory is added
        new._parameters.clear()
        new._parameters.update(bn._parameters)
        new._buffers.clear()
        new._buffers.update(bn._buffers)
        new._non_persistent_buffers_set = set(bn._non_persistent_buffers_set)
        new.train(bn.training)
        if hasattr(bn, "qconfig"):
            new.qconfig = bn.qconfig
        return new


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """``module`` with every batch norm (``nn.BatchNorm1d`` / ``2d`` / ``3d``, any
    ``_BatchNorm`` but a synced one) replaced, in place, by a :class:`SyncBatchNorm` holding
    the same tensors under the same names; the module itself is returned, or a new
    :class:`SyncBatchNorm` when ``module`` is a batch norm.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        >>> weight = net[1].weight
        >>> net = convert_sync_batchnorm(net)
        >>> type(net[1]).__name__, net[1].weight is weight
        ('SyncBatchNorm', True)
        >>> sorted(net.state_dict())  # the keys of nn.BatchNorm1d
        ['0.bias', '0.weight', '1.bias', '1.num_batches_tracked', '1.running_mean',
         '1.running_var', '1.weight']
    """
    if isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm)):
        return module
    if isinstance(module, _BatchNorm):
        return SyncBatchNorm.from_batchnorm(module, process_group)
    for name, child in list(module.named_children()):
        new = convert_sync_batchnorm(child, process_group)
        if new is not child:
            module.add_module(name, new)
    return module


def _world(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(group))


@functools.cache
def _functional_has_autograd() -> bool:
    """Whether torch's functional all-reduce is differentiable (torch 2.13 registers its
    backward; older releases have only ``torch.distributed.nn.functional.all_reduce``)."""
    try:
        import torch.distributed._functional_collectives  # registers the ops

        return bool(
            torch._C._dispatch_has_kernel_for_dispatch_key(
                "_c10d_functional::all_reduce", "Autograd"
            )
        )
    except Exception:  # an op or a function this torch does not have
        return False


def _all_reduce_sum(t: Tensor, group: Any) -> Tensor:
    """The sum of ``t`` over the ranks, differentiable (the backward sums the gradients over
    the ranks), traceable by ``torch.compile`` where torch's functional all-reduce has a
    backward."""
    if group is None:
        group = dist.group.WORLD
    if torch.compiler.is_compiling() or _functional_has_autograd():
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(t, "sum", group))
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(t, op=dist.ReduceOp.SUM, group=group)
