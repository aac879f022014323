"""The request-level traffic split between the stable and canary arms.

A canary weight is a percentage with up to two decimals (0.01 to 100), so the split works in
basis points: 1% is 100 of 10,000. A request that names its session (the OpenAI `user` field, or
an `x-session-id` header) is placed by a hash of it, so a session always lands on one arm and
moves only when the weight crosses its bucket; a request that names none is placed at random.

>>> arm_for("alice", 0.0), arm_for("alice", 100.0)
('stable', 'canary')
>>> bucket("alice") == bucket("alice")
True
"""

from __future__ import annotations

import hashlib
import random

STABLE, CANARY = "stable", "canary"
BASIS_POINTS = 10_000


def bucket(session: str) -> int:
    """A session's fixed place in [0, 10000): the first 8 bytes of its SHA-256. Any string has one:
    a lone surrogate (a JSON `\\ud800`, a header byte that is not UTF-8) is hashed as it stands.

    >>> bucket("\\ud800") == bucket("\\ud800")
    True
    """
    return int.from_bytes(hashlib.sha256(session.encode("utf-8", "surrogatepass")).digest()[:8], "big") % BASIS_POINTS


def basis_points(weight_pct: float) -> int:
    """A percentage with up to two decimals as basis points, clamped to [0, 10000]."""
    return min(max(round(weight_pct * 100), 0), BASIS_POINTS)


def arm_for(session: str | None, canary_weight_pct: float, rng: random.Random | None = None) -> str:
    """STABLE or CANARY for one request."""
    bp = basis_points(canary_weight_pct)
    if bp == 0:
        return STABLE
    if bp == BASIS_POINTS:
        return CANARY
    b = bucket(session) if session else (rng or random).randrange(BASIS_POINTS)
    return CANARY if b < bp else STABLE
