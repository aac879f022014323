"""The fleet's own decisions as the spec's rules take them (`specfleet_api.fleet_spec.FleetState`):
the SLO loop's fallbacks and method choices, and the canary's routing. One home for what the
operator's children and status and `specfleet up`'s live state are built from."""

from __future__ import annotations

from typing import Any

from specfleet_api.fleet_spec import FALLBACK, SPECULATIVE, FleetState

from . import canary as canaries
from .loop import Memory


def fleet_state(memory: Memory | None, cstate: canaries.CanaryState, spec: dict[str, Any]) -> FleetState:
    """What shapes the children and the live state: the loop's whole-deployment and per-key
    fallbacks, the methods and K ceilings it chose per prompt type, and the canary's routing (its
    weight now, the drift mirror share and epoch, a promotion record)."""
    memory = memory or Memory()
    routing = canaries.routing(cstate, spec)
    return FleetState(mode=FALLBACK if memory.whole else SPECULATIVE, canary_weight=routing.weight,
                      canary_phase=cstate.phase, fallback=memory.fallback_types(),
                      fallback_clusters=memory.fallback_clusters(), mirror_share=routing.mirror_share,
                      drift_epoch=routing.drift_epoch, promoted=cstate.promoted, methods=memory.chosen_methods(),
                      k_ceilings=memory.k_ceilings(), cluster_methods=memory.cluster_routes())
