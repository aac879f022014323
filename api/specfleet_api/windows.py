"""What the fleet observes, as it travels through Redis: the workers' windows per (arm, prompt
type), the routers' windows per prompt cluster, and the routers' output-drift counts.

Each worker publishes, per prompt type, what its requests did over its last 60 s (`TypeCounts`,
keys in `specfleet_api.live_state`); a reader sums a field over the pods of an arm. The control
loop (operator and `specfleet up`), `specfleet status` and the demo read them here. Torch-free and
Prometheus-free: the worker, the router, the operator and the local fleet all import it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable

from .live_state import ARMS, PREFIX, window_key

log = logging.getLogger("specfleet.windows")


def publish_period(window_s: float) -> float:
    """How often windows of `window_s` are published: 5 s, or a quarter of a shorter window (at
    least 0.25 s), so that a loop on a short SLO window sees each window change.

    >>> publish_period(300.0), publish_period(6.0), publish_period(0.5)
    (5.0, 1.5, 0.25)
    """
    return min(5.0, max(0.25, window_s / 4))


# Upper bounds (seconds) of the latency histograms a window carries; the last bucket is +Inf.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)


def _zeros(buckets: tuple[float, ...]) -> tuple[int, ...]:
    return (0,) * (len(buckets) + 1)


# Draft positions a window counts acceptance at (1 .. POSITIONS; deeper drafts count up to it):
# what the loop sets each prompt type's K ceiling from (specfleet_control.kbounds).
POSITIONS = 16


def bucket_of(value: float, buckets: tuple[float, ...]) -> int:
    """The histogram bucket a value counts in (len(buckets): above the last bound).

    >>> bucket_of(0.03, TTFT_BUCKETS), bucket_of(99.0, TTFT_BUCKETS)
    (2, 11)
    """
    for i, bound in enumerate(buckets):
        if value <= bound:
            return i
    return len(buckets)


def quantile(hist: tuple[int, ...], buckets: tuple[float, ...], q: float) -> float | None:
    """The q-quantile of a histogram, interpolated inside its bucket as Prometheus'
    histogram_quantile does; None when empty. Above the last bound: the last bound.

    >>> quantile((0, 10, 10) + (0,) * 9, TTFT_BUCKETS, 0.5)
    0.025
    """
    total = sum(hist)
    if total == 0:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(hist):
        if n and seen + n >= rank:
            if i == len(buckets):
                return buckets[-1]
            lo = buckets[i - 1] if i else 0.0
            return lo + (buckets[i] - lo) * (rank - seen) / n
        seen += n
    return buckets[-1]


@dataclasses.dataclass
class TypeCounts:
    """What one prompt type's requests did on one worker since it started; a fleet window is the
    difference of two. A step's seconds are shared among its sequences (the speedup meter's
    shares); the latencies are what the histograms observe. The `spec_` fields count only the
    requests that ran a draft method: in fallback those are the probes, so that the probe's speedup
    is not diluted by the plain requests beside it."""

    requests: int = 0  # finished (stop, length or abort)
    output_tokens: int = 0
    steps: int = 0  # decoding steps: target forwards after the prefill
    drafts: int = 0  # of which verified at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    plain_seconds: float = 0.0  # what plain decoding would have spent on the same steps
    busy_seconds: float = 0.0  # what they took
    ttft_seconds_sum: float = 0.0
    ttft_count: int = 0
    tpot_seconds_sum: float = 0.0
    tpot_count: int = 0
    errors: int = 0  # requests that failed inside the worker
    spec_requests: int = 0  # finished requests that ran a draft method
    spec_plain_seconds: float = 0.0
    spec_busy_seconds: float = 0.0
    # one speedup per speculating request (its plain-equivalent / busy seconds), as log sums: the
    # spread of requests' speedups says how sure a window's speedup is (specfleet_control.loop)
    spec_speedups: int = 0
    spec_log_speedup_sum: float = 0.0
    spec_log_speedup_sq: float = 0.0
    # one acceptance rate per speculating request that drafted, as sums: how sure a window's
    # alpha is at the request level (a shift in a type's traffic shows in it first)
    spec_alphas: int = 0
    spec_alpha_sum: float = 0.0
    spec_alpha_sq: float = 0.0
    ttft_hist: tuple[int, ...] = _zeros(TTFT_BUCKETS)  # counts per TTFT_BUCKETS bucket
    tpot_hist: tuple[int, ...] = _zeros(TPOT_BUCKETS)
    # per draft position p (0-based): the decoding steps whose draft reached it, and those whose
    # draft was accepted up to it (a tree: its depth, and the accepted path)
    pos_drafted: tuple[int, ...] = (0,) * POSITIONS
    pos_accepted: tuple[int, ...] = (0,) * POSITIONS

    def minus(self, earlier: TypeCounts) -> TypeCounts:
        return TypeCounts(**{f.name: _combine(getattr(self, f.name), getattr(earlier, f.name), -1)
                             for f in dataclasses.fields(self)})

    def plus(self, other: TypeCounts) -> TypeCounts:
        return TypeCounts(**{f.name: _combine(getattr(self, f.name), getattr(other, f.name), 1)
                             for f in dataclasses.fields(self)})


def _combine(a, b, sign: int):
    if isinstance(a, tuple):
        return tuple(x + sign * y for x, y in zip(a, b))
    return a + sign * b

COUNT_FIELDS = tuple(f.name for f in dataclasses.fields(TypeCounts))


def window_json(counts: TypeCounts, seconds: float, updated: float) -> str:
    """One window as a publisher writes it into its hash (what `parse_window` reads): the counts,
    the seconds they cover and when (unix seconds) they were taken.

    >>> parse_window(window_json(TypeCounts(requests=2, steps=5), 12.5, 1.0)).counts.steps
    5
    """
    return json.dumps({**dataclasses.asdict(counts), "window_seconds": round(seconds, 3), "updated": updated})


class Windows:
    """Sliding windows over a source of running totals per prompt type: each `take` records the
    totals and returns, per type, their growth since the oldest record not older than `window_s`
    (the one just before it, so that a window is never shorter than asked once the worker is old
    enough), with the seconds it covers."""

    def __init__(self, totals: Callable[[], dict[str, TypeCounts]], window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self.totals, self.window_s, self.clock = totals, window_s, clock
        self._history: deque[tuple[float, dict[str, TypeCounts]]] = deque([(clock(), totals())])

    def take(self) -> tuple[float, dict[str, TypeCounts]]:
        now, current = self.clock(), self.totals()
        self._history.append((now, current))
        while len(self._history) > 2 and self._history[1][0] <= now - self.window_s:
            self._history.popleft()
        since, base = self._history[0]
        return now - since, {t: c.minus(base.get(t, TypeCounts())) for t, c in current.items()}


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

    @property
    def spec_speedup(self) -> float | None:
        """The speedup of the requests that speculated (in fallback: the probes); None without any."""
        c = self.counts
        return c.spec_plain_seconds / c.spec_busy_seconds if c.spec_busy_seconds > 0 else None

    @property
    def ttft(self) -> float | None:
        """Mean time to first token (seconds)."""
        c = self.counts
        return c.ttft_seconds_sum / c.ttft_count if c.ttft_count else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (seconds)."""
        c = self.counts
        return c.tpot_seconds_sum / c.tpot_count if c.tpot_count else None

    def ttft_quantile(self, q: float) -> float | None:
        return quantile(self.counts.ttft_hist, TTFT_BUCKETS, q)

    def tpot_quantile(self, q: float) -> float | None:
        return quantile(self.counts.tpot_hist, TPOT_BUCKETS, q)

    @property
    def error_rate(self) -> float | None:
        c = self.counts
        done = c.requests + c.errors
        return c.errors / done if done else None

    def plus(self, other: Window) -> Window:
        """Two windows as one (pods of one arm, or the arms of one prompt type).

        >>> a = Window(TypeCounts(steps=10, draft_tokens=8, accepted_tokens=4), 1, 60.0)
        >>> b = Window(TypeCounts(steps=10, draft_tokens=2, accepted_tokens=2), 1, 30.0)
        >>> w = a.plus(b)
        >>> w.alpha, w.tau, w.pods, w.seconds
        (0.6, 1.3, 2, 60.0)
        """
        counts = self.counts.plus(other.counts)
        return Window(counts, self.pods + other.pods, max(self.seconds, other.seconds))


def parse_window(text: str | bytes) -> Window:
    """One pod's window of one prompt type (the JSON a worker writes); ValueError when it is not one.

    >>> parse_window('{"requests": 2, "steps": 5, "draft_tokens": 4, "accepted_tokens": 3, "window_seconds": 12.5}').tau
    1.6
    """
    try:
        raw = json.loads(text)
        empty, fields = TypeCounts(), {}
        for f in COUNT_FIELDS:
            default = getattr(empty, f)
            if isinstance(default, tuple):
                value = tuple(int(n) for n in raw.get(f, default))
                if len(value) != len(default):
                    raise ValueError(f"{f} has {len(value)} buckets, not {len(default)}")
                fields[f] = value
            else:
                fields[f] = type(default)(raw.get(f, 0))
        counts = TypeCounts(**fields)
        return Window(counts, 1, float(raw.get("window_seconds", 0.0)))
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"not a window ({type(e).__name__}: {e})") from None


def sum_windows(windows: list[Window]) -> Window:
    out = Window()
    for w in windows:
        out = out.plus(w)
    return out


# A worker's hash holds, beside each prompt type's window, one per (prompt type, draft method) its
# requests ran: field `<type>@<method>` (the method a request ran, exploration and probes included),
# so that the loop can compare methods on the same type.
METHOD_SEP = "@"


def method_field(prompt_type: str, method: str) -> str:
    """The hash field of one (prompt type, draft method)'s window.

    >>> method_field("code", "eagle")
    'code@eagle'
    """
    return f"{prompt_type}{METHOD_SEP}{method}"


def _read_fields(client, namespace: str, name: str, arms: tuple[str, ...]) -> dict[str, dict[str, Window]]:
    out: dict[str, dict[str, Window]] = {}
    for arm in arms:
        by_field: dict[str, Window] = {}
        for key in client.scan_iter(match=window_key(namespace, name, arm) + ":*", count=100):
            for field, text in client.hgetall(key).items():
                field = field.decode() if isinstance(field, bytes) else field
                try:
                    w = parse_window(text)
                except ValueError as e:
                    log.warning("ignoring a window", extra={"key": key, "prompt_type": field, "error": str(e)})
                    continue
                by_field[field] = by_field.get(field, Window()).plus(w)
        out[arm] = by_field
    return out


def split_fields(by_field: dict[str, Window]) -> tuple[dict[str, Window], dict[str, dict[str, Window]]]:
    """A hash's fields as ({prompt type: Window}, {prompt type: {method: Window}}).

    >>> types, methods = split_fields({"code": Window(pods=1), "code@ngram": Window(pods=2)})
    >>> list(types), {t: list(m) for t, m in methods.items()}
    (['code'], {'code': ['ngram']})
    """
    types: dict[str, Window] = {}
    methods: dict[str, dict[str, Window]] = {}
    for field, w in by_field.items():
        prompt_type, sep, method = field.partition(METHOD_SEP)
        if sep:
            methods.setdefault(prompt_type, {})[method] = w
        else:
            types[field] = w
    return types, methods


def read_windows(client, namespace: str, name: str, arms: tuple[str, ...] = ARMS) -> dict[str, dict[str, Window]]:
    """{arm: {prompt type: Window}} summed over the pods found now (a dead pod's key has expired).
    Redis errors propagate: the caller decides what missing data means (never a decision)."""
    return {arm: split_fields(f)[0] for arm, f in _read_fields(client, namespace, name, arms).items()}


def read_all_windows(client, namespace: str, name: str, arms: tuple[str, ...] = ARMS
                     ) -> tuple[dict[str, dict[str, Window]], dict[str, dict[str, dict[str, Window]]]]:
    """({arm: {prompt type: Window}}, {arm: {prompt type: {method: Window}}}) in one read."""
    by_arm = {arm: split_fields(f) for arm, f in _read_fields(client, namespace, name, arms).items()}
    return {arm: t for arm, (t, _) in by_arm.items()}, {arm: m for arm, (_, m) in by_arm.items()}


def cluster_key(namespace: str, name: str, router: str) -> str:
    """One router's windows per prompt cluster: a hash, field = cluster id, value = ClusterWindow JSON.

    >>> cluster_key("default", "chat", "chat-router-5c-x")
    'specfleet:v1:default/chat:clusters:chat-router-5c-x'
    """
    return f"{PREFIX}{namespace}/{name}:clusters:{router}"


@dataclasses.dataclass(frozen=True)
class ClusterMethod:
    """One draft method's speculating requests in a prompt cluster, on the stable arm: what the
    loop compares the methods on per cluster (specfleet_control.methods). Seconds are each
    request's speculating steps, plain-equivalent and actual (the worker's SpeculationStats)."""

    requests: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    plain_seconds: float = 0.0
    busy_seconds: float = 0.0
    speedups: int = 0  # requests with both seconds, whose log speedups are summed below
    log_speedup_sum: float = 0.0
    log_speedup_sq: float = 0.0
    alphas: int = 0  # requests that drafted, whose acceptance rates are summed below
    alpha_sum: float = 0.0
    alpha_sq: float = 0.0

    def plus_request(self, draft_tokens: int, accepted_tokens: int, plain_s: float, busy_s: float) -> ClusterMethod:
        """This one with one more request counted.

        >>> c = ClusterMethod().plus_request(8, 4, 2.0, 1.0).plus_request(4, 1, 1.0, 1.0)
        >>> c.speedups, c.alphas, c.alpha_sum
        (2, 2, 0.75)
        """
        log = math.log(plain_s / busy_s) if plain_s > 0 and busy_s > 0 else None
        alpha = accepted_tokens / draft_tokens if draft_tokens > 0 else None
        return ClusterMethod(self.requests + 1, self.draft_tokens + draft_tokens, self.accepted_tokens + accepted_tokens,
                             self.plain_seconds + plain_s, self.busy_seconds + busy_s,
                             self.speedups + (log is not None), self.log_speedup_sum + (log or 0.0),
                             self.log_speedup_sq + (log or 0.0) ** 2, self.alphas + (alpha is not None),
                             self.alpha_sum + (alpha or 0.0), self.alpha_sq + (alpha or 0.0) ** 2)


@dataclasses.dataclass(frozen=True)
class ClusterWindow:
    """What one prompt cluster's requests did over a router's last window. Cluster ids are the
    router's own (`<router>/<n>`: each router learns its clusters online), so a reader never sums
    two routers' clusters; the loop decides per cluster, the router routes its own. Counts come
    from the speculation statistics on each response's last message; `methods` splits the stable
    arm's speculating requests by draft method."""

    prompt_type: str
    requests: int = 0
    spec_requests: int = 0  # of which ran a draft method (in fallback: the probes)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    seconds: float = 0.0
    methods: dict[str, ClusterMethod] = dataclasses.field(default_factory=dict)

    @property
    def alpha(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> ClusterWindow:
        """ValueError naming what is wrong.

        >>> ClusterWindow.from_json('{"prompt_type": "code", "draft_tokens": 10, "accepted_tokens": 4}').alpha
        0.4
        """
        try:
            raw = json.loads(text)
            methods = {str(m): ClusterMethod(**{f.name: (int if f.type == "int" else float)(c.get(f.name, 0))
                                                for f in dataclasses.fields(ClusterMethod)})
                       for m, c in (raw.get("methods") or {}).items()}
            return cls(prompt_type=str(raw["prompt_type"]), requests=int(raw.get("requests", 0)),
                       spec_requests=int(raw.get("spec_requests", 0)), draft_tokens=int(raw.get("draft_tokens", 0)),
                       accepted_tokens=int(raw.get("accepted_tokens", 0)), seconds=float(raw.get("seconds", 0.0)),
                       methods=methods)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"not a cluster window ({type(e).__name__}: {e})") from None


def _text(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


def read_cluster_windows(client, namespace: str, name: str) -> dict[str, ClusterWindow]:
    """{cluster id: window} over every router found now; Redis errors propagate."""
    out: dict[str, ClusterWindow] = {}
    for key in client.scan_iter(match=cluster_key(namespace, name, "*"), count=100):
        for cluster, text in client.hgetall(key).items():
            try:
                out[_text(cluster)] = ClusterWindow.from_json(text)
            except ValueError as e:
                log.warning("ignoring a cluster window", extra={"key": key, "error": str(e)})
    return out


def drift_key(namespace: str, name: str, router: str) -> str:
    """One router's output-drift counts: a hash, field = pair kind ("canary": stable vs canary,
    "control": stable vs stable), value = DriftCounts JSON.

    >>> drift_key("default", "chat", "r1")
    'specfleet:v1:default/chat:drift:r1'
    """
    return f"{PREFIX}{namespace}/{name}:drift:{router}"


DRIFT_KINDS = ("canary", "control")


@dataclasses.dataclass(frozen=True)
class DriftCounts:
    """Greedy requests mirrored to two backends, counted since the canary run `epoch` began
    (LiveState.drift_epoch): how many pairs answered, how many agreed token for token, and the
    first pair that did not (request id, position, the two tokens). For sampled requests, `scored`
    pairs of teacher-forced per-token log-probabilities are summarised as the two-sample statistic's
    inputs (`logprob_*`), filled where the router scores them."""

    epoch: str
    pairs: int = 0
    agree: int = 0
    first_diff: dict | None = None  # {"request_id", "position", "a", "b"}
    scored: int = 0
    logprob_diff_sum: float = 0.0
    logprob_diff_sq_sum: float = 0.0
    logprob_tokens: int = 0

    @property
    def agreement(self) -> float | None:
        return self.agree / self.pairs if self.pairs else None

    def plus(self, other: DriftCounts) -> DriftCounts:
        return DriftCounts(self.epoch, self.pairs + other.pairs, self.agree + other.agree,
                           self.first_diff or other.first_diff, self.scored + other.scored,
                           self.logprob_diff_sum + other.logprob_diff_sum,
                           self.logprob_diff_sq_sum + other.logprob_diff_sq_sum,
                           self.logprob_tokens + other.logprob_tokens)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> DriftCounts:
        try:
            raw = json.loads(text)
            fd = raw.get("first_diff")
            return cls(epoch=str(raw["epoch"]), pairs=int(raw.get("pairs", 0)), agree=int(raw.get("agree", 0)),
                       first_diff=dict(fd) if fd else None, scored=int(raw.get("scored", 0)),
                       logprob_diff_sum=float(raw.get("logprob_diff_sum", 0.0)),
                       logprob_diff_sq_sum=float(raw.get("logprob_diff_sq_sum", 0.0)),
                       logprob_tokens=int(raw.get("logprob_tokens", 0)))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"not drift counts ({type(e).__name__}: {e})") from None


def read_drift(client, namespace: str, name: str, epoch: str) -> dict[str, DriftCounts]:
    """{kind: counts} summed over the routers, only those of `epoch` (another canary run's, or a
    router that has not seen the new epoch yet, are not this run's evidence)."""
    out: dict[str, DriftCounts] = {}
    for key in client.scan_iter(match=drift_key(namespace, name, "*"), count=100):
        for kind, text in client.hgetall(key).items():
            kind = _text(kind)
            try:
                d = DriftCounts.from_json(text)
            except ValueError as e:
                log.warning("ignoring drift counts", extra={"key": key, "error": str(e)})
                continue
            if d.epoch == epoch and kind in DRIFT_KINDS:
                out[kind] = out[kind].plus(d) if kind in out else d
    return out
