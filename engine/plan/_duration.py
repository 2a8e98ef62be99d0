"""Durations as Lightning writes them (``max_time``, ``Timer(duration=...)``): a private module with
no engine imports, so the flag checks (``engine.driver._checks``) and the Timer listener share
it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import timedelta

__all__ = ["parse_duration"]

_DURATION = re.compile(r"(\d+):(\d\d):(\d\d):(\d\d)")


def parse_duration(value: str | timedelta | Mapping[str, float] | None) -> timedelta | None:
    """A duration as a ``timedelta``: from ``"DD:HH:MM:SS"``, a timedelta or timedelta's keywords.

    Args:
        value: ``"DD:HH:MM:SS"`` (days may have any number of digits, the rest two each), a
            ``timedelta``, a dict of ``timedelta`` keywords (``{"hours": 12}``) or ``None``.

    Returns:
        The duration, or ``None`` for ``None``.

    Raises:
        ValueError: if the string is not ``DD:HH:MM:SS``, the dict has keys ``timedelta``
            does not take, or the duration is negative.
        TypeError: for any other type.

    Example:
        >>> from engine.listeners import parse_duration
        >>> parse_duration("01:12:00:30")
        datetime.timedelta(days=1, seconds=43230)
        >>> parse_duration({"minutes": 90})
        datetime.timedelta(seconds=5400)
    """
    if value is None:
        return None
    if isinstance(value, timedelta):
        duration = value
    elif isinstance(value, str):
        m = _DURATION.fullmatch(value.strip())
        if m is None:
            raise ValueError(
                f"duration {value!r} is not DD:HH:MM:SS (days:hours:minutes:seconds, e.g. "
                "'00:12:00:00' for 12 hours); pass such a string, a timedelta or a dict like "
                "{'hours': 12}"
            )
        days, hours, minutes, seconds = map(int, m.groups())
        duration = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    elif isinstance(value, Mapping):
        try:
            duration = timedelta(**value)
        except TypeError as e:
            raise ValueError(
                f"duration {dict(value)!r} is not a set of timedelta keywords ({e}); use "
                "weeks, days, hours, minutes, seconds, milliseconds or microseconds"
            ) from None
    else:
        raise TypeError(
            f"duration must be a 'DD:HH:MM:SS' string, a timedelta or a dict of timedelta "
            f"keywords (got {type(value).__name__} {value!r})"
        )
    if duration < timedelta(0):
        raise ValueError(f"duration must not be negative (got {value!r})")
    return duration
