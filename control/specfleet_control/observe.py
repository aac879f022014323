"""What one tick of the loop sees: the fleet's windows in Redis (workers per arm and prompt type,
routers per prompt cluster, mirrored pairs for drift), the alerts firing for the deployment, and
the arms' readiness. Reading is the only impure part of the loop: `read` takes a Redis client and
turns any failure into an incomplete observation, on which nothing is decided.
"""

from __future__ import annotations

import dataclasses

from specfleet_api.live_state import ARMS
from specfleet_api.windows import (ClusterWindow, DriftCounts, Window, read_all_windows, read_cluster_windows,
                                   read_drift)


@dataclasses.dataclass(frozen=True)
class Alert:
    """An alert firing for the deployment (Alertmanager's webhook); `prompt_type` None: all of it."""

    name: str
    prompt_type: str | None = None


@dataclasses.dataclass(frozen=True)
class Observation:
    complete: bool = True  # False: the windows could not be read (Redis away); decide nothing
    windows: dict[str, dict[str, Window]] = dataclasses.field(default_factory=dict)  # arm -> type -> window
    # arm -> type -> draft method -> window: the requests of each type that ran each method
    methods: dict[str, dict[str, dict[str, Window]]] = dataclasses.field(default_factory=dict)
    clusters: dict[str, ClusterWindow] = dataclasses.field(default_factory=dict)  # cluster id -> window
    drift: dict[str, DriftCounts] = dataclasses.field(default_factory=dict)  # pair kind -> counts
    alerts: tuple[Alert, ...] = ()
    ready: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # arm -> (ready, desired)
    error: str = ""  # why it is incomplete

    def with_alerts(self, alerts: tuple[Alert, ...]) -> Observation:
        return dataclasses.replace(self, alerts=tuple(alerts))


def read(client, namespace: str, name: str, arms: tuple[str, ...] = ARMS, drift_epoch: str = "") -> Observation:
    """Everything the fleet published for this deployment, now; never raises."""
    try:
        windows, methods = read_all_windows(client, namespace, name, arms)
        clusters = read_cluster_windows(client, namespace, name)
        drift = read_drift(client, namespace, name, drift_epoch) if drift_epoch else {}
    except Exception as e:  # noqa: BLE001 - redis errors, timeouts: no data, no decision
        return Observation(complete=False, error=f"{type(e).__name__}: {e}")
    return Observation(windows=windows, methods=methods, clusters=clusters, drift=drift)
