"""What the operator exports: per-fleet gauges under labels a scrape keeps, the loop's decisions."""
import doctest

from prometheus_client import REGISTRY

from specfleet_operator import metrics
from specfleet_operator import spec as specs


def test_the_docstrings_hold():
    for module in (metrics, specs):
        assert doctest.testmod(module).failed == 0


def value(name, **labels):
    return REGISTRY.get_sample_value(name, labels)


def test_fallback_per_prompt_type_and_clusters_and_each_decision_are_exported():
    status = {"mode": "speculative", "canary": {"weight": 1.0},
              "fallback": {"promptTypes": ["code"], "clusters": ["r/1", "r/2"]}}
    metrics.export_state("ns-m", "fleet", status)
    labels = {"sdd_namespace": "ns-m", "sdd_name": "fleet"}
    assert value("specfleet_fallback_prompt_type_active", prompt_type="code", **labels) == 1
    assert value("specfleet_fallback_prompt_type_active", prompt_type="chat", **labels) == 0
    assert value("specfleet_fallback_clusters", **labels) == 2
    assert value("specfleet_fallback_active", **labels) == 0
    events = [("FallbackEntered", "prompt type code: speculation off: ..."),
              ("FallbackLeft", "prompt cluster r/1 (code): speculation back on"),
              ("MethodChanged", "prompt type code: eagle -> ngram: speedup 1.08x ..."),
              ("MethodChanged", "prompt type chat: eagle -> ngram: speedup 1.10x ..."),
              ("KCeilingChanged", "prompt type translation (ngram): kMax none -> 1: ..."),
              ("CanaryPromoted", "canary promoted: ...")]
    for reason, message in events:
        metrics.record_decision("ns-m", "fleet", reason, message)
    assert value("specfleet_loop_decisions_total", reason="FallbackEntered", scope="prompt_type", **labels) == 1
    assert value("specfleet_loop_decisions_total", reason="FallbackLeft", scope="cluster", **labels) == 1
    assert value("specfleet_loop_decisions_total", reason="MethodChanged", scope="prompt_type", **labels) == 2
    assert value("specfleet_loop_decisions_total", reason="KCeilingChanged", scope="prompt_type", **labels) == 1
    assert value("specfleet_loop_decisions_total", reason="CanaryPromoted", scope="deployment", **labels) == 1
    metrics.forget("ns-m", "fleet")
    assert value("specfleet_fallback_prompt_type_active", prompt_type="code", **labels) is None
