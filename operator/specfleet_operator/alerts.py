"""Alerts that act: Alertmanager's webhook posts (payload version 4) kept as the alerts now firing
per fleet, for the control loop to treat an SLO alert as it treats a missed SLO it saw itself.

`parse` checks a post and names what is wrong with it; `AlertInbox` is what the HTTP server's thread
writes and the loop reads (`slo_misses(namespace, name, now)`, for `Observation.with_alerts`);
`BearerToken` is the receiver's secret.
The HTTP side (status codes, the route) is health.py's; the rules that raise these alerts are
manifests.alert_rules (docs/alerts.md).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import threading
import time
from collections.abc import Iterable
from datetime import datetime
from typing import Any, NamedTuple

from specfleet_control.observe import Alert as LoopAlert

from .manifests import ALERT_ALPHA, ALERT_SPEEDUP, ALERT_VLLM_ALPHA, PROM_LABEL_SDD, label_value

#: Alerts that mean the SLO is missed: the loop enters the same fallback as on its own observation
#: (a vLLM pool's, which names no prompt type, for the whole fleet).
SLO_ALERTS = frozenset({ALERT_ALPHA, ALERT_SPEEDUP, ALERT_VLLM_ALPHA})
#: Where an alert names its fleet, most specific first: the rules' own labels, then what a scrape
#: leaves of the operator's older `namespace`/`name` labels and the workers' pod label.
NAMESPACE_LABELS = ("sdd_namespace", "exported_namespace")
NAME_LABELS = ("sdd_name", PROM_LABEL_SDD)
#: A firing alert not heard of again for this long is dropped (Alertmanager resends firing alerts
#: every repeat_interval: docs/alerts.md sets 5m, so three resends may be lost before it expires).
DEFAULT_TTL_S = 900.0
MAX_ALERTS = 10_000  # per post; Alertmanager truncates groups far below this (max_alerts)
#: How long a resolved alert's episode (fingerprint, startsAt) is remembered, so that a replay of
#: one of its firing posts is a no-op; and how many are remembered at most (the oldest go first).
ENDED_RETENTION_S = 86_400.0
MAX_ENDED = 100_000


class PayloadError(ValueError):
    """A post that is not an Alertmanager v4 webhook payload; the message names the field."""


@dataclasses.dataclass(frozen=True)
class WebhookAlert:
    """One entry of a webhook post's `alerts`."""
    status: str  # firing or resolved
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float  # epoch seconds
    ends_at: float | None  # None: Alertmanager's zero time (no end known)
    fingerprint: str

    @property
    def alertname(self) -> str:
        return self.labels.get("alertname", "")

    @property
    def fleet(self) -> tuple[str, str] | None:
        """(namespace, name label value) of the fleet the alert is about, None when it names none."""
        ns = next((self.labels[k] for k in NAMESPACE_LABELS if self.labels.get(k)), None)
        name = next((self.labels[k] for k in NAME_LABELS if self.labels.get(k)), None)
        return (ns, name) if ns and name else None


@dataclasses.dataclass(frozen=True)
class FiringAlert:
    """What the loop reads: `prompt_type` None means the whole deployment."""
    alertname: str
    prompt_type: str | None
    since: float  # epoch seconds (startsAt)
    fingerprint: str
    summary: str = ""

    @property
    def slo_miss(self) -> bool:
        return self.alertname in SLO_ALERTS


def _timestamp(value: Any, where: str) -> float | None:
    """RFC 3339 (Alertmanager writes nanoseconds, which fromisoformat truncates) to epoch seconds;
    None for Go's zero time, which Alertmanager sends for an end not yet known."""
    if not isinstance(value, str):
        raise PayloadError(f"{where}: expected an RFC 3339 time string, got {type(value).__name__}")
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise PayloadError(f"{where}: {value!r} is not an RFC 3339 time") from None
    if t.tzinfo is None:
        raise PayloadError(f"{where}: {value!r} has no time zone (RFC 3339 needs Z or an offset)")
    return None if t.year <= 1 else t.timestamp()


def _strings(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise PayloadError(f"{where}: expected an object of string values")
    return value


def parse(body: bytes) -> list[WebhookAlert]:
    """The alerts of one webhook post.

    >>> a, = parse(b'{"version": "4", "status": "firing", "alerts": [{"status": "firing",'
    ...            b' "labels": {"alertname": "X"}, "startsAt": "2026-12-01T16:40:00.5Z",'
    ...            b' "endsAt": "0001-01-01T00:00:00Z", "fingerprint": "f1"}]}')
    >>> a.alertname, a.starts_at, a.ends_at
    ('X', 1796143200.5, None)
    >>> parse(b'{"version": "3", "alerts": []}')
    Traceback (most recent call last):
    ...
    specfleet_operator.alerts.PayloadError: version: expected "4" (Alertmanager's webhook payload), got '3'
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PayloadError(f"body: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise PayloadError(f"body: expected a JSON object, got {type(doc).__name__}")
    if doc.get("version") != "4":
        raise PayloadError(f'version: expected "4" (Alertmanager\'s webhook payload), got {doc.get("version")!r}')
    alerts = doc.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("alerts: expected a list")
    if len(alerts) > MAX_ALERTS:
        raise PayloadError(f"alerts: {len(alerts)} in one post, at most {MAX_ALERTS}")
    out = []
    for i, a in enumerate(alerts):
        where = f"alerts[{i}]"
        if not isinstance(a, dict):
            raise PayloadError(f"{where}: expected an object")
        status = a.get("status")
        if status not in ("firing", "resolved"):
            raise PayloadError(f"{where}.status: expected firing or resolved, got {status!r}")
        labels = _strings(a.get("labels"), f"{where}.labels")
        annotations = _strings(a.get("annotations", {}), f"{where}.annotations")
        starts = _timestamp(a.get("startsAt"), f"{where}.startsAt")
        ends = _timestamp(a["endsAt"], f"{where}.endsAt") if a.get("endsAt") is not None else None
        fingerprint = a.get("fingerprint")
        if fingerprint is None:  # Alertmanager always sends one; another sender keys by the labels
            fingerprint = hashlib.sha256(json.dumps(labels, sort_keys=True).encode()).hexdigest()[:16]
        elif not isinstance(fingerprint, str) or not fingerprint:
            raise PayloadError(f"{where}.fingerprint: expected a non-empty string")
        out.append(WebhookAlert(status, labels, annotations, starts or 0.0, ends, fingerprint))
    return out


class Recorded(NamedTuple):
    """What one post did: alerts naming a fleet, and how many of those were replays (no-ops)."""
    matched: int
    replayed: int = 0


class AlertInbox:
    """The alerts firing now, by fingerprint. The HTTP server's thread records; the loop, in
    asyncio, reads: one lock. The clock (epoch seconds) is passed in, as everywhere in the loop.

    An alert's episode is its (fingerprint, startsAt). Once its resolution is taken, a firing post
    of that episode is a replay and changes nothing (so is one older than the episode firing now);
    a new episode of the same alert (a later startsAt) fires again.

    >>> inbox = AlertInbox(ttl_s=600)
    >>> firing = WebhookAlert("firing", {"alertname": "SpecDecodeAlphaBelowSLO", "sdd_namespace": "ml",
    ...                "sdd_name": "chat", "prompt_type": "code"}, {}, 100.0, None, "f1")
    >>> inbox.record([firing], now=100.0)
    Recorded(matched=1, replayed=0)
    >>> [(a.alertname, a.prompt_type, a.slo_miss) for a in inbox.firing("ml", "chat", now=200.0)]
    [('SpecDecodeAlphaBelowSLO', 'code', True)]
    >>> inbox.slo_misses("ml", "chat", now=200.0)  # what the loop's Observation.with_alerts takes
    (Alert(name='SpecDecodeAlphaBelowSLO', prompt_type='code'),)
    >>> inbox.firing("ml", "chat", now=701.0)  # not resent within the TTL
    []
    >>> _ = inbox.record([firing], now=800.0)
    >>> _ = inbox.record([dataclasses.replace(firing, status="resolved")], now=810.0)
    >>> inbox.firing("ml", "chat", now=811.0)
    []
    >>> inbox.record([firing], now=900.0), inbox.firing("ml", "chat", now=901.0)  # a replay: no-op
    (Recorded(matched=1, replayed=1), [])
    >>> _ = inbox.record([dataclasses.replace(firing, starts_at=950.0)], now=950.0)  # a new episode
    >>> len(inbox.firing("ml", "chat", now=951.0))
    1
    """

    def __init__(self, ttl_s: float = DEFAULT_TTL_S):
        self.ttl_s = ttl_s
        self._firing: dict[str, tuple[WebhookAlert, float]] = {}  # fingerprint -> (alert, expires at)
        # fingerprint -> (startsAt of the last episode resolved, when that was taken)
        self._ended: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def _replay(self, a: WebhookAlert) -> bool:
        """Whether a firing post is of an episode already over, or older than the one firing."""
        ended = self._ended.get(a.fingerprint)
        current = self._firing.get(a.fingerprint)
        return (ended is not None and a.starts_at <= ended[0]) or \
            (current is not None and a.starts_at < current[0].starts_at)

    def record(self, alerts: Iterable[WebhookAlert], now: float | None = None) -> Recorded:
        """Take in one post's alerts (those naming no fleet are ignored)."""
        now = time.time() if now is None else now
        matched = replayed = 0
        with self._lock:
            for fp in [fp for fp, (_, at) in self._ended.items() if at < now - ENDED_RETENTION_S]:
                del self._ended[fp]
            for a in alerts:
                if a.fleet is None:
                    continue
                matched += 1
                current = self._firing.get(a.fingerprint)
                if a.status == "resolved":
                    if current is None or current[0].starts_at <= a.starts_at:  # never ends a later episode
                        self._firing.pop(a.fingerprint, None)
                    if a.starts_at >= self._ended.get(a.fingerprint, (a.starts_at, 0.0))[0]:
                        self._ended.pop(a.fingerprint, None)  # re-inserted last: the dict stays oldest first
                        self._ended[a.fingerprint] = (a.starts_at, now)
                        while len(self._ended) > MAX_ENDED:
                            del self._ended[next(iter(self._ended))]
                elif self._replay(a):
                    replayed += 1
                else:
                    # endsAt may lie ahead (Prometheus' resend horizon), but Alertmanager posts again
                    # only every repeat_interval: keep it for the TTL at least. A resend of the same
                    # episode changes nothing the loop sees (same alert, same since) but its expiry.
                    self._firing[a.fingerprint] = (a, max(a.ends_at or 0.0, now + self.ttl_s))
        return Recorded(matched, replayed)

    def firing(self, namespace: str, name: str, now: float) -> list[FiringAlert]:
        """The fleet's alerts firing at `now`, oldest first; expired ones are dropped."""
        names = {name, label_value(name)}  # the chart's rules carry the pod label, which is shortened
        out = []
        with self._lock:
            for fp, (a, expires) in list(self._firing.items()):
                if expires <= now:
                    del self._firing[fp]
                elif a.fleet is not None and a.fleet[0] == namespace and a.fleet[1] in names:
                    out.append(FiringAlert(a.alertname, a.labels.get("prompt_type") or None, a.starts_at, fp,
                                           a.annotations.get("summary", "")))
        return sorted(out, key=lambda f: (f.since, f.fingerprint))

    def slo_misses(self, namespace: str, name: str, now: float) -> tuple[LoopAlert, ...]:
        """The firing SLO alerts as the loop's observation takes them (`Observation.with_alerts`)."""
        return tuple(LoopAlert(a.alertname, a.prompt_type) for a in self.firing(namespace, name, now) if a.slo_miss)


class BearerToken:
    """The receiver's shared secret: a file (a mounted Secret key, re-read so that a rotated Secret
    takes effect) or a literal. None of either: the receiver is off."""

    def __init__(self, path: str | None = None, value: str | None = None):
        self.path, self.value = path, value

    def get(self) -> str | None:
        if self.value:
            return self.value
        if not self.path:
            return None
        try:
            with open(self.path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError:
            return None
        return token or None

    def refusal(self, authorization: str | None, token: str) -> str | None:
        """Why an Authorization header is refused, or None when it carries `token`."""
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return "missing bearer token (expected the header Authorization: Bearer <token>)"
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            return "wrong bearer token"
        return None

    @classmethod
    def from_env(cls, path: str | None) -> BearerToken:
        return cls(path=path or os.environ.get("SPECFLEET_ALERTMANAGER_TOKEN_FILE") or None,
                   value=os.environ.get("SPECFLEET_ALERTMANAGER_TOKEN") or None)
