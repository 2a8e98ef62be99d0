"""Per-step randomness derived from ``(seed, step, micro_step, stream)``, never from global state.

A step that draws random numbers (dropout, noise, augmentation on the fly) runs inside
:func:`seeded`, which forks the process's generators, seeds them with :func:`derive_seed` and puts
the caller's generator states back afterwards. Re-running a step from a saved state therefore
redraws exactly the same numbers, and the caller's ``torch.rand`` sequence is unaffected.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["TRAIN", "EVAL", "PREDICT", "derive_seed", "seeded"]

# Streams keep the randomness of different step kinds independent.
TRAIN, EVAL, PREDICT = 0, 1, 2

_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    # SplitMix64 finaliser: a bijection on 64-bit ints with good avalanche, so nearby
    # (step, micro_step) pairs give unrelated seeds.
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def derive_seed(
    seed: int, step: int, micro_step: int = 0, stream: int = TRAIN, rank: int = 0
) -> int:
    """The 63-bit seed for one step; a pure function of its arguments.

    ``rank``: the data-parallel rank that runs the step. Each rank trains on its own shard,
    so each draws its own numbers (dropout masks): rank 0's are the one-process run's, the
    others' are mixed with their rank (ranks drawing alike would correlate the noise of
    samples that one process would draw independently).

    Example:
        >>> derive_seed(0, 10) == derive_seed(0, 10)
        True
        >>> derive_seed(0, 10) != derive_seed(0, 11)
        True
    """
    z = _mix64(seed & _MASK64)
    for part in (step, micro_step, stream):
        z = _mix64(z ^ (part & _MASK64))
    if rank:
        z = _mix64(z ^ ((rank << 32) & _MASK64))
    return z >> 1  # torch generators take seeds below 2**63 without complaint on every backend


class seeded:
    """Run the body with the CPU (and given accelerator) generators seeded, then restore them.

    ``cuda_devices`` names the CUDA devices whose generators are seeded too; ``"mps"`` in it
    stands for Apple's MPS generator.

    This is :func:`torch.random.fork_rng` reduced to what a step needs: ``fork_rng`` looks up
    the accelerator module on every entry, which costs more than the rest of a small compiled
    step's Python overhead put together.

    Example:
        >>> import torch
        >>> with seeded(7):
        ...     a = torch.rand(2)
        >>> with seeded(7):
        ...     b = torch.rand(2)
        >>> bool((a == b).all())
        True
    """

    __slots__ = ("_saved", "cuda_devices", "seed")

    def __init__(self, seed: int, cuda_devices: Sequence[int | str] = ()) -> None:
        self.seed = seed
        self.cuda_devices = cuda_devices
        self._saved: list[tuple[torch.Generator, torch.Tensor]] = []

    def __enter__(self) -> None:
        gens = [torch.random.default_generator]
        for d in self.cuda_devices:
            gens.append(
                _mps_generator() if isinstance(d, str) else torch.cuda.default_generators[d]
            )
        self._saved = [(g, g.get_state()) for g in gens]
        for g in gens:
            g.manual_seed(self.seed)

    def __exit__(self, *exc: object) -> None:
        for g, state in self._saved:
            g.set_state(state)
        self._saved = []


def _mps_generator() -> torch.Generator:
    return torch.mps._get_default_mps_generator()
