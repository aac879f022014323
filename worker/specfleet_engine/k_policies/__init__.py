"""K policies: how many draft tokens each step verifies. One protocol (`base.KPolicy`), one
registry keyed by the API's `KPolicy` enum (the CRD's `speculation.kPolicy`)."""

from __future__ import annotations

from specfleet_api.enums import K_POLICIES, KPolicy as PolicyName

from .adaptive import AdaptivePolicy
from .base import Cost, KPolicy, best_k, choose_ks, expected_tokens
from .fixed import FixedPolicy

POLICIES = {PolicyName.ADAPTIVE.value: AdaptivePolicy, PolicyName.FIXED.value: FixedPolicy}
assert tuple(POLICIES) == K_POLICIES, "every K policy the API names has an implementation"


def make_policy(name: str, costs: Cost, max_slowdown: float | None = None) -> KPolicy:
    """The policy the CRD's kPolicy names, priced by `costs` (the engine's StepCostModel).

    max_slowdown: the adaptive policy's latency guard (`speculation.latencyGuard`, a fraction;
    None: off). A fixed policy verifies its whole draft: it has no budget to guard."""
    if name not in POLICIES:
        raise ValueError(f"kPolicy must be one of {', '.join(POLICIES)}, got {name!r}")
    if max_slowdown is not None and not 0.0 <= max_slowdown:
        raise ValueError(f"max_slowdown must be a fraction >= 0 (0.02: 2%), got {max_slowdown!r}")
    return AdaptivePolicy(costs, max_slowdown=max_slowdown) if name == PolicyName.ADAPTIVE else FixedPolicy()


__all__ = ["AdaptivePolicy", "Cost", "FixedPolicy", "KPolicy", "POLICIES", "best_k", "choose_ks",
           "expected_tokens", "make_policy"]
