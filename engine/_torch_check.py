"""The torch releases engine supports, checked first when the package is imported.

``pyproject.toml`` declares the same minimum (``torch>=2.13``), which pip enforces at install;
this check covers the rest: a checkout on ``PYTHONPATH``, an install with ``--no-deps``, a torch
changed afterwards. Without it an older torch fails deep inside, at the first compiled step,
far from the cause:

* before 2.11, every compiled step: it traces ``torch.autograd.grad`` into its graph, which
  Dynamo does only with ``torch._dynamo.config.trace_autograd_ops`` (new in 2.11);
* before 2.13, a compiled step under DDP or FSDP: its gradients' all-reduce takes the ``id()``
  of tensors made inside the graph (``engine/parallel/ddp.py``), which Dynamo refuses before
  2.13 ("call_id() without source").

The other tests the README lists passed on 2.10 too; the README says which ran where.

``ENGINE_ALLOW_UNSUPPORTED_TORCH=1`` turns the error into a warning, for a machine whose torch
cannot be changed (a lent GPU machine with its own image): what works there is what the list
above leaves, and nothing more is promised.

Only the release numbers are compared: a pre-release, nightly or source build of a supported
release (``2.13.0rc1``, ``2.14.0.dev20260101``, ``2.13.0a0+git1234``) passes, and so does a
version this module cannot read (a custom build's own scheme), rather than being refused unread.
"""

from __future__ import annotations

import os
import re
import warnings

__all__ = ["MINIMUM", "check", "release"]

#: The oldest torch release engine supports, as ``(major, minor)``.
MINIMUM = (2, 13)

_RELEASE = re.compile(r"(\d+)\.(\d+)")


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string (``"2.13.0+cpu"`` -> ``(2, 13)``), or None
    when it does not start with two numbers."""
    found = _RELEASE.match(version.strip())
    return (int(found[1]), int(found[2])) if found else None


def check(version: str, where: str = "") -> None:
    """Raise ``ImportError`` if torch ``version`` is older than :data:`MINIMUM`.

    Args:
        version: ``torch.__version__``.
        where: where that torch is installed, for the message (its directory).
    """
    found = release(version)
    if found is None or found >= MINIMUM:
        return
    minimum = ".".join(map(str, MINIMUM))
    if os.environ.get("ENGINE_ALLOW_UNSUPPORTED_TORCH") == "1":
        warnings.warn(
            f"engine supports torch>={minimum}; running on torch {version} because "
            "ENGINE_ALLOW_UNSUPPORTED_TORCH=1: a compiled step under DDP or FSDP fails before 2.13 "
            "and every compiled step before 2.11",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    raise ImportError(
        f"engine supports torch {minimum} or newer (torch>={minimum}); this Python has torch "
        f"{version}{f' ({where})' if where else ''}. Install a supported release: "
        f"pip install 'torch>={minimum}' (the CPU build: add --index-url "
        "https://download.pytorch.org/whl/cpu)"
    )


def _check_installed() -> None:
    import torch

    check(torch.__version__, next(iter(getattr(torch, "__path__", [])), ""))


_check_installed()
