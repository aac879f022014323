"""Prompt clusters: a cheap embedding of each prompt and clusters learned online per prompt type,
so that the loop can fall back where alpha collapses inside a type that is healthy on average
(a rare programming language, a new domain's jargon).

The embedding is the set of the lowercased text's character 1- to 3-grams, feature-hashed with a
random sign into DIMS buckets (a fixed sparse random projection of the n-gram vector: one ±1 per
n-gram, from a keyed hash, so every router in the fleet computes the same vector for the same text
with no table to ship), normalised to unit length. 3-grams alone leave two short texts of one kind
(two Finnish sentences) near orthogonal; the shorter grams carry the alphabet and the punctuation
that make a kind of text recognisable. Each n-gram counts once, so that spaces and common letters
do not make every text alike. DIMS is 256, not 64: a projection adds noise of about 1/sqrt(DIMS) to
a cosine, and at 64 it was as large as the gap between two kinds (measured in
tests/router/test_clusters.py's prompts). Clustering is leader clustering with running means: a prompt
joins the most similar cluster when its similarity reaches the threshold, else opens a cluster while
the prompt type has fewer than `max_clusters`, else joins the most similar one.

A prompt's similarity to a cluster is its mean cosine to the cluster's members: the dot product
with the running mean of their unit vectors, not the cosine to that mean. A mean of many vectors
averages their noise away and grows shorter, so the cosine to it rises with the cluster's size: a
German translation cluster of 40 prompts sat at cosine 0.32-0.50 to Finnish prompts of the same
template (0.28 mean to its members), over the threshold, and swallowed them in 30 of 40 arrival
orders; by mean similarity they sit at 0.22-0.34 and its own unseen prompts at 0.40-0.49, whatever
its size (tests/router/test_clusters.py).
Cluster ids are `<router>/<n>`, the router's own: they are not comparable across routers.

>>> c = Clusters("r0", max_clusters=4)
>>> a = c.assign("code", "def add(a, b):\\n    return a + b")
>>> b = c.assign("code", "def sub(a, b):\\n    return a - b")
>>> d = c.assign("code", "Hyvää huomenta, kuinka voit tänään?")
>>> a, a == b, d
('r0/0', True, 'r0/1')
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

from specfleet_api.windows import ClusterMethod, ClusterWindow

DIMS = 256
NGRAMS = (1, 2, 3)
MAX_CHARS = 512  # a prompt's head: enough to tell kinds apart, in about a millisecond
SEED = b"specfleet-clusters-v1"  # changing it changes every vector: a new version of the embedding
DEFAULT_MAX_CLUSTERS = 16
DEFAULT_THRESHOLD = 0.35  # mean similarity: German vs Finnish prompts of one translation template part at 0.35
DEFAULT_WINDOW_S = 60.0


@lru_cache(maxsize=1 << 16)
def _feature(gram: str) -> tuple[int, float]:
    """An n-gram's bucket and sign."""
    h = int.from_bytes(hashlib.blake2b(gram.encode(), digest_size=8, key=SEED).digest(), "big")
    return h % DIMS, 1.0 if h >> 63 else -1.0


def embed(text: str) -> tuple[float, ...] | None:
    """The unit-length embedding of a text; None when it has fewer than 3 characters (too short to say).

    >>> v = embed("Hello, world")
    >>> len(v), round(sum(x * x for x in v), 6), embed("Hello, world") == v, embed("hi")
    (256, 1.0, True, None)
    """
    text = text.lower()[:MAX_CHARS]
    if len(text) < NGRAMS[-1]:
        return None
    v = [0.0] * DIMS
    for gram in {text[i:i + n] for n in NGRAMS for i in range(len(text) - n + 1)}:
        bucket, sign = _feature(gram)
        v[bucket] += sign
    norm = math.sqrt(sum(x * x for x in v))
    return tuple(x / norm for x in v) if norm else tuple(v)


@dataclass
class Cluster:
    id: str
    centroid: list[float]  # the running mean of its members' unit vectors
    count: int = 0

    def similarity(self, v: tuple[float, ...]) -> float:
        """The mean cosine of a unit vector to the members (the dot product with their mean)."""
        return sum(c * x for c, x in zip(self.centroid, v))

    def add(self, v: tuple[float, ...]) -> None:
        self.count += 1
        self.centroid = [c + (x - c) / self.count for c, x in zip(self.centroid, v)]


@dataclass
class Clusters:
    """One router's clusters, per prompt type, learned from the prompts it sees."""

    router: str
    max_clusters: int = DEFAULT_MAX_CLUSTERS
    threshold: float = DEFAULT_THRESHOLD
    by_type: dict[str, list[Cluster]] = field(default_factory=dict)
    opened: int = 0  # ids are numbered across prompt types, so an id names one type's cluster

    def __post_init__(self):
        if self.max_clusters < 1:
            raise ValueError(f"max clusters: need at least 1, got {self.max_clusters}")
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"cluster similarity threshold: a mean cosine in [-1, 1], got {self.threshold}")

    def assign(self, prompt_type: str, text: str) -> str | None:
        """The cluster id of a prompt (learning from it); None when the text is too short to embed."""
        v = embed(text)
        if v is None:
            return None
        clusters = self.by_type.setdefault(prompt_type, [])
        best, sim = None, -2.0
        for c in clusters:
            s = c.similarity(v)
            if s > sim:
                best, sim = c, s
        if best is None or (sim < self.threshold and len(clusters) < self.max_clusters):
            best = Cluster(f"{self.router}/{self.opened}", list(v))
            self.opened += 1
            clusters.append(best)
        best.add(v)
        return best.id


class ClusterWindows:
    """Per cluster, what its requests did over the last `window_s` seconds, from the speculation
    statistics on each response's last message (what the router publishes for the loop).

    >>> from specfleet_proto import worker_pb2 as pb
    >>> now = [0.0]
    >>> w = ClusterWindows(60.0, clock=lambda: now[0])
    >>> w.record("r/0", "code", pb.SpeculationStats(method="ngram", num_draft_tokens=8, num_accepted_tokens=2))
    >>> now[0] = 30.0
    >>> w.record("r/0", "code", pb.SpeculationStats(method="none"))
    >>> w.snapshot()["r/0"]   # doctest: +NORMALIZE_WHITESPACE
    ClusterWindow(prompt_type='code', requests=2, spec_requests=1, draft_tokens=8, accepted_tokens=2, seconds=30.0,
                  methods={'ngram': ClusterMethod(requests=1, draft_tokens=8, accepted_tokens=2, plain_seconds=0.0,
                  busy_seconds=0.0, speedups=0, log_speedup_sum=0.0, log_speedup_sq=0.0, alphas=1, alpha_sum=0.25,
                  alpha_sq=0.0625)})
    >>> now[0] = 75.0
    >>> w.snapshot()["r/0"].requests, w.snapshot()["r/0"].seconds
    (1, 60.0)
    """

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0:
            raise ValueError(f"fleet window: need a positive number of seconds, got {window_s}")
        self.window_s, self.clock = window_s, clock
        # cluster -> (prompt type, first seen, [(when, spec, draft tokens, accepted tokens, method or
        # None, plain-equivalent and actual seconds)])
        self._events: dict[str, tuple[str, float, deque]] = {}

    def record(self, cluster: str, prompt_type: str, speculation, arm: str = "stable") -> None:
        """One answered request; its method's counts too where it speculated on the stable arm
        (the arm whose methods the loop chooses)."""
        now = self.clock()
        if cluster not in self._events:
            self._events[cluster] = (prompt_type, now, deque())
        spec = speculation.method not in ("", "none")
        method = speculation.method if spec and arm == "stable" else None
        self._events[cluster][2].append((now, spec, speculation.num_draft_tokens, speculation.num_accepted_tokens,
                                         method, speculation.spec_plain_seconds, speculation.spec_busy_seconds))

    def snapshot(self) -> dict[str, ClusterWindow]:
        """{cluster id: its window now}; a cluster with no request in the window is left out (and
        forgotten)."""
        now = self.clock()
        out = {}
        for cluster, (prompt_type, first, events) in list(self._events.items()):
            while events and events[0][0] < now - self.window_s:
                events.popleft()
            if not events:
                del self._events[cluster]
                continue
            methods: dict[str, ClusterMethod] = {}
            for _, _, drafted, accepted, method, plain_s, busy_s in events:
                if method is not None:
                    methods[method] = methods.get(method, ClusterMethod()).plus_request(drafted, accepted, plain_s,
                                                                                         busy_s)
            out[cluster] = ClusterWindow(prompt_type, requests=len(events), spec_requests=sum(e[1] for e in events),
                                         draft_tokens=sum(e[2] for e in events),
                                         accepted_tokens=sum(e[3] for e in events),
                                         seconds=min(self.window_s, now - first), methods=methods)
        return out
