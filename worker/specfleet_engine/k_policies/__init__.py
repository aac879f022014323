"""K policies: how many draft tokens each step verifies. One protocol (`base.KPolicy`), one
registry keyed by the API's `KPolicy` enum (the CRD's `speculation.kPolicy`)."""

from __future__ import annotations

from specfleet_api.enums import K_POLICIES, KPolicy as PolicyName

from .adaptive import AdaptivePolicy
from .base import Cost, KPolicy, best_k, choose_ks, expected_tokens
from .confidence import DEFAULT_MIN_CONFIDENCE, ConfidencePolicy
from .entropy import DEFAULT_MAX_ENTROPY, EntropyPolicy
from .fixed import FixedPolicy

POLICIES = {PolicyName.ADAPTIVE.value: AdaptivePolicy, PolicyName.FIXED.value: FixedPolicy,
            PolicyName.CONFIDENCE.value: ConfidencePolicy, PolicyName.ENTROPY.value: EntropyPolicy}
assert tuple(POLICIES) == K_POLICIES, "every K policy the API names has an implementation"


def make_policy(name: str, costs: Cost, max_slowdown: float | None = None) -> KPolicy:
    """The policy the CRD's kPolicy names, priced by `costs` (the engine's StepCostModel).

    max_slowdown: the adaptive policy's latency guard (`speculation.latencyGuard`, a fraction;
    None: off). A fixed policy verifies its whole draft: it has no budget to guard; the confidence
    and entropy policies verify what clears their thresholds (DEFAULT_MIN_CONFIDENCE,
    DEFAULT_MAX_ENTROPY), node by node: no budget either (k_policies/threshold.py says why)."""
    if name not in POLICIES:
        raise ValueError(f"kPolicy must be one of {', '.join(POLICIES)}, got {name!r}")
    if max_slowdown is not None and not 0.0 <= max_slowdown:
        raise ValueError(f"max_slowdown must be a fraction >= 0 (0.02: 2%), got {max_slowdown!r}")
    if name == PolicyName.ADAPTIVE:
        return AdaptivePolicy(costs, max_slowdown=max_slowdown)
    return FixedPolicy() if name == PolicyName.FIXED else POLICIES[name](costs)


__all__ = ["AdaptivePolicy", "ConfidencePolicy", "Cost", "DEFAULT_MAX_ENTROPY", "DEFAULT_MIN_CONFIDENCE",
           "EntropyPolicy", "FixedPolicy", "KPolicy", "POLICIES", "best_k", "choose_ks", "expected_tokens",
           "make_policy"]
