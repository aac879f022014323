"""Where the control loop's observations come from, and what the operator itself exports.

`ScrapeSource` reads the workers' Prometheus text from the per-role metrics Services (the
worker keeps its gauges over a sliding window, so one scrape is one window's view). Any object
with the same `observe` coroutine can stand in (tests pass a fixed one).
"""
from __future__ import annotations

import statistics
from typing import Any, Protocol

import aiohttp
from prometheus_client import Gauge
from prometheus_client.parser import text_string_to_metric_families

from .manifests import Settings, child_name
from .policy import Metrics, RoleMetrics

FALLBACK_ACTIVE = Gauge("specfleet_fallback_active", "1 while a fleet decodes without speculation",
                        ["namespace", "name"])
CANARY_WEIGHT = Gauge("specfleet_canary_weight", "Percent of workers on the canary", ["namespace", "name"])


class MetricsSource(Protocol):
    async def observe(self, namespace: str, name: str, has_canary: bool) -> Metrics: ...


def parse_role_metrics(text: str) -> RoleMetrics:
    """Summarise one worker's /metrics text.
    >>> parse_role_metrics('spec_decode_acceptance_rate{model="m",prompt_type="code"} 0.6\\n'
    ...                    'spec_decode_acceptance_rate{model="m",prompt_type="chat"} 0.4\\n').alpha
    0.5
    """
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values.setdefault(sample.name, []).append(sample.value)

    def mean(name: str) -> float | None:
        return statistics.fmean(values[name]) if values.get(name) else None

    def total(name: str) -> float:
        return sum(values.get(name, []))

    requests = total("spec_decode_requests_total")
    failed = total("spec_decode_failed_requests_total")
    return RoleMetrics(alpha=mean("spec_decode_acceptance_rate"),
                       mean_accepted_length=mean("spec_decode_avg_accepted_tokens"),
                       speedup=mean("spec_decode_total_speedup_ratio"),
                       error_rate=(failed / requests) if requests else None)


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
