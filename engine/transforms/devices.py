"""Lightning's ``accelerator`` and ``devices`` flags, resolved to the one device a run uses.

=================  ==========================================================================
``accelerator``    ``"auto"`` (CUDA if available, else MPS, else the CPU), ``"cpu"``,
                   ``"gpu"`` / ``"cuda"``, ``"mps"``
``devices``        ``1`` (or ``"1"``), ``"auto"``, ``-1`` (or ``"-1"``: all, which must be one),
                   a list ``[i]`` or a string ``"i,"`` naming device ``i``
=================  ==========================================================================

More than one device is one process per device under a multi-process strategy (``"ddp"``):
:func:`resolve_devices` gives them. ``devices="auto"`` means one device (Lightning's ``"auto"``
takes every GPU: ``devices=-1`` does that here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "ACCELERATORS",
    "available_accelerators",
    "check_device",
    "resolve_device",
    "resolve_devices",
]

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
# Lightning names these; engine runs none of them
_ELSEWHERE = ("tpu", "hpu", "ipu", "xla", "xpu", "neuron")
_MULTI = (
    "more than one device needs a multi-process strategy: pass strategy='ddp' (or 'auto'), or "
    "devices=1 (or a list with one index, devices=[1])"
)


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _mps() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def available_accelerators() -> list[str]:
    """What this machine offers, e.g. ``["cuda:0 (NVIDIA H200)", "cpu"]``, for error messages."""
    found = [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(_cuda_count())]
    if _mps():
        found.append("mps")
    return [*found, "cpu"]


def _indices(devices: Any, name: str) -> list[int] | int | None:
    """``devices`` as a list of indices, a count, or ``None`` for "auto"/-1 ("all"); a value
    of none of these is refused with what accelerator ``name`` takes."""
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto" or text == "-1":
            return None
        if "," in text:
            parts = [p.strip() for p in text.split(",") if p.strip()]
            if parts and all(p.isdigit() for p in parts):
                return [int(p) for p in parts]
        elif text.isdigit() and int(text) >= 1:  # "0" is no device, as Lightning reads it
            return int(text)
    elif isinstance(devices, bool):
        pass
    elif isinstance(devices, int):
        if devices == -1:
            return None
        if devices >= 1:
            return devices
    elif (
        isinstance(devices, Sequence)
        and devices
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in devices)
    ):
        return list(devices)
    raise ValueError(f"Trainer(devices={devices!r}): {_takes(name)}")


def _takes(name: str) -> str:
    """What ``devices`` may be on accelerator ``name`` (``"cpu"``, ``"cuda"``, ``"mps"``)."""
    if name == "cuda":
        return (
            f"on CUDA pass a number of GPUs from 1 to {max(_cuda_count(), 1)} (one process "
            "each: more than one needs strategy='ddp' or 'fsdp', or 'auto'), -1 for every GPU, "
            "'auto' for one, or their indices such as [0, 1] or '0,1'"
        )
    if name == "mps":
        return "MPS is one device: pass 1, 'auto', -1 or [0]"
    return (
        "on the CPU pass a number of processes N >= 1 "
        "(N > 1 trains data parallel: strategy='ddp', 'fsdp' or 'auto'), 'auto' or -1 for "
        "one process, or [0] / '0,'"
    )


def resolve_device(accelerator: Any = "auto", devices: Any = "auto") -> torch.device:
    """The one device a run on ``accelerator`` with ``devices`` uses (Lightning's flags).

    Raises:
        ValueError: for an accelerator engine does not run on, one this machine does not have
            (the message lists what it has), an index past the devices found, or more than one
            device (:func:`resolve_devices` gives those, one per process of a multi-process
            strategy).

    Example:
        >>> resolve_device("cpu", 1)
        device(type='cpu')
        >>> resolve_device("cpu", 2)
        Traceback (most recent call last):
        ...
        ValueError: Trainer(devices=2): more than one device needs a multi-process strategy...
    """
    found = resolve_devices(accelerator, devices)
    if len(found) > 1:
        raise ValueError(f"Trainer(devices={devices!r}): {_MULTI}")
    return found[0]


def resolve_devices(accelerator: Any = "auto", devices: Any = "auto") -> tuple[torch.device, ...]:
    """The devices of a run, one per process on this node: ``devices=4`` on the CPU is four
    processes on the CPU; on CUDA, devices ``0..3`` (or the listed indices).

    ``"auto"`` is one device (Lightning's ``"auto"`` takes every GPU: pass ``devices=-1`` for
    that); ``-1`` is every GPU, or one CPU process.

    Example:
        >>> resolve_devices("cpu", 2)
        (device(type='cpu'), device(type='cpu'))
        >>> resolve_devices("cpu", "auto")
        (device(type='cpu'),)
    """
    if not isinstance(accelerator, str):
        raise ValueError(
            f"Trainer(accelerator={accelerator!r}): accepted values are "
            f"{', '.join(map(repr, ACCELERATORS))}"
        )
    name = accelerator.lower()
    if name in _ELSEWHERE:
        raise ValueError(
            f"Trainer(accelerator={accelerator!r}): engine runs on the CPU, NVIDIA GPUs ('gpu' / "
            f"'cuda') and Apple's MPS; {accelerator!r} is not supported"
        )
    if name not in ACCELERATORS:
        raise ValueError(
            f"Trainer(accelerator={accelerator!r}): accepted values are "
            f"{', '.join(map(repr, ACCELERATORS))}"
        )
    if name == "auto":
        name = "cuda" if _cuda_count() else "mps" if _mps() else "cpu"
    if name == "gpu":
        name = "cuda" if _cuda_count() or not _mps() else "mps"
    found = ", ".join(available_accelerators())
    if name == "mps" and not _mps():
        raise ValueError(
            f"Trainer(accelerator={accelerator!r}): MPS is not available; this machine has: "
            f"{found}. Pass accelerator='cpu' or 'auto'"
        )
    if name == "cuda":
        count = _cuda_count()
        if count == 0:
            raise ValueError(
                f"Trainer(accelerator={accelerator!r}): no CUDA GPU is available (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); this machine "
                f"has: {found}. Pass accelerator='cpu' or 'auto'"
            )
        wanted = _indices(devices, name)  # what CUDA takes, once there is one
        if wanted is None:  # "auto": one; -1: all
            n = count if devices in (-1, "-1") else 1
            return tuple(torch.device("cuda", i) for i in range(n))
        if isinstance(wanted, int):
            if wanted > count:
                raise ValueError(
                    f"Trainer(devices={devices!r}): this machine has {count} CUDA device(s): "
                    f"{found}"
                )
            return tuple(torch.device("cuda", i) for i in range(wanted))
        if len(set(wanted)) != len(wanted):
            raise ValueError(f"Trainer(devices={devices!r}): a device is listed twice")
        for i in wanted:
            if i >= count:
                raise ValueError(
                    f"Trainer(devices={devices!r}): there is no CUDA device {i}; this "
                    f"machine has: {found}"
                )
        return tuple(torch.device("cuda", i) for i in wanted)
    wanted = _indices(devices, name)
    if name == "mps" and (
        (isinstance(wanted, int) and wanted > 1) or (isinstance(wanted, list) and len(wanted) > 1)
    ):
        raise ValueError(f"Trainer(devices={devices!r}): MPS is one device; pass devices=1")
    if isinstance(wanted, list):
        if any(i != 0 for i in wanted) or len(wanted) > 1:
            raise ValueError(
                f"Trainer(devices={devices!r}): {name} has one device, index 0 (for several "
                f"processes on it pass a count, devices=2); this machine has: {found}"
            )
        return (torch.device(name),)
    # the CPU: a count of processes ("auto" and -1: one)
    return tuple(torch.device(name) for _ in range(wanted if isinstance(wanted, int) else 1))


def check_device(device: torch.device, what: str) -> torch.device:
    """``device`` if this machine has it (a placement given directly, ``plugins=[SingleDevice(
    ...)]``), else a ``ValueError`` naming ``what`` and what the machine has."""
    found = ", ".join(available_accelerators())
    index = device.index
    if device.type == "cuda":
        ok = _cuda_count() > (index or 0)
    elif device.type == "mps":
        ok = _mps() and not index
    elif device.type == "cpu":
        ok = not index
    else:
        ok = False
    if not ok:
        raise ValueError(
            f"{what}: this machine has no device {str(device)!r}; it has: {found} (engine runs "
            "on the CPU, CUDA GPUs and MPS)"
        )
    return device
