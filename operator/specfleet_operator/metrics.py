"""Where the control loop's observations come from, and what the operator itself exports.

`ScrapeSource` reads the workers' Prometheus text from the per-role metrics Services (the
worker keeps its gauges over a sliding window, so one scrape is one window's view). Any object
with the same `observe` coroutine can stand in (tests pass a fixed one).
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Protocol

import aiohttp
from prometheus_client import Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from .manifests import Settings, child_name
from .policy import Metrics, RoleMetrics

# Per-fleet label names: not `namespace`, which Prometheus' own target label takes over (renaming
# ours `exported_namespace`), so that rules, dashboards and the alert receiver all see these.
SDD_LABELS = ("sdd_namespace", "sdd_name")
FALLBACK_ACTIVE = Gauge("specfleet_fallback_active", "1 while a fleet decodes without speculation", SDD_LABELS)
CANARY_WEIGHT = Gauge("specfleet_canary_weight", "Percent of requests the router sends to the canary", SDD_LABELS)
ALERTS_RECEIVED = Counter("specfleet_alerts_received", "Alerts taken from Alertmanager webhook posts, by status",
                          ["status"])
ALERT_POSTS_REFUSED = Counter("specfleet_alertmanager_refused_requests",
                              "Posts to /alertmanager refused, by reason", ["reason"])
#: The worker's arrival-to-last-token histogram: what a canary's p99LatencySeconds check reads.
E2E_LATENCY = "spec_decode_e2e_request_latency_seconds"


class MetricsSource(Protocol):
    async def observe(self, namespace: str, name: str, has_canary: bool) -> Metrics: ...


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram ({upper bound: count at or below}), interpolated
    linearly inside its bucket as Prometheus' histogram_quantile does; None without observations.
    A quantile in the +Inf bucket is the highest finite bound (all the histogram can say).

    >>> histogram_quantile(0.99, {0.5: 0, 1.0: 90, 2.0: 100, math.inf: 100})  # 99th of 100 in (1, 2]
    1.9
    >>> histogram_quantile(0.99, {1.0: 0, math.inf: 0}) is None
    True
    """
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf or buckets[math.inf] <= 0:
        return None
    rank = q * buckets[math.inf]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == math.inf:
                return lower
            # the first bucket's lower edge is 0: latencies are not negative
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return None


def parse_role_metrics(text: str) -> RoleMetrics:
    """Summarise one worker's /metrics text. P99 latency is over the histogram as exported: from
    the worker's start (a canary's pods start with the canary).
    >>> parse_role_metrics('spec_decode_acceptance_rate{model="m",prompt_type="code"} 0.6\\n'
    ...                    'spec_decode_acceptance_rate{model="m",prompt_type="chat"} 0.4\\n').alpha
    0.5
    """
    values: dict[str, list[float]] = {}
    latency: dict[float, float] = {}  # summed over label sets (model), as sum by (le) would
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values.setdefault(sample.name, []).append(sample.value)
            if sample.name == f"{E2E_LATENCY}_bucket":
                le = float(sample.labels["le"])
                latency[le] = latency.get(le, 0.0) + sample.value

    def mean(name: str) -> float | None:
        return statistics.fmean(values[name]) if values.get(name) else None

    def total(name: str) -> float:
        return sum(values.get(name, []))

    requests = total("spec_decode_requests_total")
    failed = total("spec_decode_failed_requests_total")
    return RoleMetrics(alpha=mean("spec_decode_acceptance_rate"),
                       mean_accepted_length=mean("spec_decode_avg_accepted_tokens"),
                       speedup=mean("spec_decode_total_speedup_ratio"),
                       error_rate=(failed / requests) if requests else None,
                       p99_latency_seconds=histogram_quantile(0.99, latency))


class ScrapeSource:
    def __init__(self, settings: Settings, timeout_s: float = 5.0, cluster_domain: str = "svc"):
        self.settings, self.timeout, self.domain = settings, aiohttp.ClientTimeout(total=timeout_s), cluster_domain
        self._session: aiohttp.ClientSession | None = None

    async def _scrape(self, namespace: str, service: str) -> RoleMetrics | None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        url = f"http://{service}.{namespace}.{self.domain}:{self.settings.http_port}/metrics"
        try:
            async with self._session.get(url) as resp:
                if resp.status != 200:
                    return None
                return parse_role_metrics(await resp.text())
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None  # no observation: the loops leave the state as it is

    async def observe(self, namespace: str, name: str, has_canary: bool) -> Metrics:
        stable = await self._scrape(namespace, child_name(name, "metrics"))
        canary = await self._scrape(namespace, child_name(name, "canary-metrics")) if has_canary else None
        return Metrics(stable=stable, canary=canary)


def export_state(namespace: str, name: str, status: dict[str, Any]) -> None:
    FALLBACK_ACTIVE.labels(namespace, name).set(1 if status.get("mode") == "fallback" else 0)
    CANARY_WEIGHT.labels(namespace, name).set(status.get("canary", {}).get("weight", 0))


def forget(namespace: str, name: str) -> None:
    for gauge in (FALLBACK_ACTIVE, CANARY_WEIGHT):
        try:
            gauge.remove(namespace, name)
        except KeyError:
            pass
