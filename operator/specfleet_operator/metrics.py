"""What the operator itself exports (the fleets' own numbers are the workers' and routers').

The control loop reads the fleet's windows in Redis (specfleet_control.observe), not these; they
are for dashboards and alerts: which fleets are in fallback, whole or per prompt type, how many
prompt clusters are, each decision of the loop and the canary analysis (by reason and scope), the
canary's share, the Alertmanager receiver's posts, and the reconciles themselves (their seconds,
errors and how many wait on a fleet's lock).
"""
from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from specfleet_api.enums import PROMPT_TYPES
from specfleet_control.loop import event_scope

# Per-fleet label names: not `namespace`, which Prometheus' own target label takes over (renaming
# ours `exported_namespace`), so that rules, dashboards and the alert receiver all see these.
SDD_LABELS = ("sdd_namespace", "sdd_name")
FALLBACK_ACTIVE = Gauge("specfleet_fallback_active", "1 while a fleet decodes without speculation", SDD_LABELS)
CANARY_WEIGHT = Gauge("specfleet_canary_weight", "Percent of requests the router sends to the canary", SDD_LABELS)
ALERTS_RECEIVED = Counter("specfleet_alerts_received", "Alerts taken from Alertmanager webhook posts, by status",
                          ["status"])
ALERT_POSTS_REFUSED = Counter("specfleet_alertmanager_refused_requests",
                              "Posts to /alertmanager refused, by reason", ["reason"])
FALLBACK_PROMPT_TYPE = Gauge("specfleet_fallback_prompt_type_active",
                             "1 while a prompt type of a fleet runs plain decoding (its probes aside)",
                             [*SDD_LABELS, "prompt_type"])
FALLBACK_CLUSTERS = Gauge("specfleet_fallback_clusters", "Prompt clusters of a fleet in fallback (clusters are "
                          "never labels: status.fallback.clusters names them)", SDD_LABELS)
LOOP_DECISIONS = Counter("specfleet_loop_decisions", "The control loop's and the canary analysis' decisions (each "
                         "an Event with its evidence), by reason (FallbackEntered, MethodChanged, TrafficShifted, "
                         "KCeilingChanged, CanaryPromoted, ...) and scope (deployment, prompt_type, cluster)",
                         [*SDD_LABELS, "reason", "scope"])

REDIS_AUTH_FAILURES = Gauge("specfleet_redis_auth_failures", "Failed Redis logins as a fleet's own user whose "
                            "latest came in the last 2 minutes (the default Redis' ACL LOG): > 0 means pods of "
                            "the fleet hold credentials Redis refuses", SDD_LABELS)

RECONCILE_SECONDS = Histogram("specfleet_operator_reconcile_seconds", "Seconds one reconcile of a fleet took "
                              "(children applied, status written), the wait for its lock excluded",
                              buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
RECONCILE_ERRORS = Counter("specfleet_operator_reconcile_errors", "Reconcile errors, by kind: exception (the "
                           "reconcile raised; kopf retries it), apply (a child the API refused)", ["kind"])
RECONCILES_WAITING = Gauge("specfleet_operator_reconciles_waiting",
                           "Reconciles waiting on a fleet's lock (another reconcile of it runs)")


def record_decision(namespace: str, name: str, reason: str, message: str) -> None:
    """Count one event of the loop or the canary analysis (its message names the key's scope first)."""
    LOOP_DECISIONS.labels(namespace, name, reason, event_scope(message)).inc()


def export_state(namespace: str, name: str, status: dict[str, Any]) -> None:
    FALLBACK_ACTIVE.labels(namespace, name).set(1 if status.get("mode") == "fallback" else 0)
    CANARY_WEIGHT.labels(namespace, name).set(status.get("canary", {}).get("weight", 0))
    fallback = status.get("fallback") or {}
    types = set(fallback.get("promptTypes") or ())
    for t in PROMPT_TYPES:
        FALLBACK_PROMPT_TYPE.labels(namespace, name, t).set(1 if t in types else 0)
    FALLBACK_CLUSTERS.labels(namespace, name).set(len(fallback.get("clusters") or ()))


def export_auth_failures(namespace: str, name: str, count: int | None) -> None:
    """The fleet's failed logins (None: unknown, or a fleet without its own user: no series)."""
    if count is None:
        try:
            REDIS_AUTH_FAILURES.remove(namespace, name)
        except KeyError:
            pass
    else:
        REDIS_AUTH_FAILURES.labels(namespace, name).set(count)


def forget(namespace: str, name: str) -> None:
    for gauge in (FALLBACK_ACTIVE, CANARY_WEIGHT, FALLBACK_CLUSTERS, REDIS_AUTH_FAILURES):
        try:
            gauge.remove(namespace, name)
        except KeyError:
            pass
    for t in PROMPT_TYPES:
        try:
            FALLBACK_PROMPT_TYPE.remove(namespace, name, t)
        except KeyError:
            pass
