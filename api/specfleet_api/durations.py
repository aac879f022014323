"""Go-style durations ("30s", "5m", "1h30m", "500ms"), as the CRD's duration fields spell them."""

from __future__ import annotations

import re

_DURATION = re.compile(r"(\d+)(ms|s|m|h)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds in a Go-style duration; ValueError names what was wrong.

    >>> parse_duration("1m30s"), parse_duration("250ms")
    (90.0, 0.25)
    """
    parts = _DURATION.findall(text or "")
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{text!r} is not a duration like 30s, 5m or 1h30m")
    return sum(int(n) * _UNITS[u] for n, u in parts)
