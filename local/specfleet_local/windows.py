"""The workers' windows in Redis, read back and summed per (arm, prompt type).

Each worker publishes, per prompt type, what its requests did over its last 60 s (the layout is
`specfleet_api.live_state`'s, the counts `specfleet_worker.metrics.TypeCounts`); a reader sums
a field over the pods of an arm. `specfleet status`, the demo and the local loop read them here.
"""

from __future__ import annotations

import dataclasses
import json
import logging

from specfleet_api.live_state import ARMS, window_key
from specfleet_worker.metrics import TypeCounts

log = logging.getLogger("specfleet.local")

COUNT_FIELDS = tuple(f.name for f in dataclasses.fields(TypeCounts))


@dataclasses.dataclass(frozen=True)
class Window:
    """One (arm, prompt type)'s counts summed over its pods; `seconds` is the longest window among
    them (a young worker's covers its life so far)."""

    counts: TypeCounts = dataclasses.field(default_factory=TypeCounts)
    pods: int = 0
    seconds: float = 0.0

    @property
    def alpha(self) -> float | None:
        """Accepted / drafted tokens; None when nothing was drafted."""
        c = self.counts
        return c.accepted_tokens / c.draft_tokens if c.draft_tokens else None

    @property
    def tau(self) -> float | None:
        """Tokens per target forward (decoding steps only); None before any step."""
        c = self.counts
        return (c.accepted_tokens + c.steps) / c.steps if c.steps else None

    @property
    def speedup(self) -> float | None:
        """Plain decoding's time for the same steps / the time they took."""
        c = self.counts
        return c.plain_seconds / c.busy_seconds if c.busy_seconds > 0 else None

    def plus(self, other: Window) -> Window:
        """Two windows as one (pods of one arm, or the arms of one prompt type).

        >>> a = Window(TypeCounts(steps=10, draft_tokens=8, accepted_tokens=4), 1, 60.0)
        >>> b = Window(TypeCounts(steps=10, draft_tokens=2, accepted_tokens=2), 1, 30.0)
        >>> w = a.plus(b)
        >>> w.alpha, w.tau, w.pods, w.seconds
        (0.6, 1.3, 2, 60.0)
        """
        counts = TypeCounts(**{f: getattr(self.counts, f) + getattr(other.counts, f) for f in COUNT_FIELDS})
        return Window(counts, self.pods + other.pods, max(self.seconds, other.seconds))


def parse_window(text: str | bytes) -> Window:
    """One pod's window of one prompt type (the JSON a worker writes); ValueError when it is not one.

    >>> parse_window('{"requests": 2, "steps": 5, "draft_tokens": 4, "accepted_tokens": 3, "window_seconds": 12.5}').tau
    1.6
    """
    try:
        raw = json.loads(text)
        counts = TypeCounts(**{f: type(getattr(TypeCounts, f))(raw.get(f, 0)) for f in COUNT_FIELDS})
        return Window(counts, 1, float(raw.get("window_seconds", 0.0)))
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"not a window ({type(e).__name__}: {e})") from None


def sum_windows(windows: list[Window]) -> Window:
    out = Window()
    for w in windows:
        out = out.plus(w)
    return out


def read_windows(client, namespace: str, name: str, arms: tuple[str, ...] = ARMS) -> dict[str, dict[str, Window]]:
    """{arm: {prompt type: Window}} summed over the pods found now (a dead pod's key has expired).
    Redis errors propagate: the caller decides what missing data means (never a decision)."""
    out: dict[str, dict[str, Window]] = {}
    for arm in arms:
        by_type: dict[str, Window] = {}
        for key in client.scan_iter(match=window_key(namespace, name, arm) + ":*", count=100):
            for prompt_type, text in client.hgetall(key).items():
                prompt_type = prompt_type.decode() if isinstance(prompt_type, bytes) else prompt_type
                try:
                    w = parse_window(text)
                except ValueError as e:
                    log.warning("ignoring a window", extra={"key": key, "prompt_type": prompt_type, "error": str(e)})
                    continue
                by_type[prompt_type] = by_type.get(prompt_type, Window()).plus(w)
        out[arm] = by_type
    return out
