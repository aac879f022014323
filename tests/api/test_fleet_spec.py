"""What a spec means (specfleet_api.fleet_spec): one rule for "speculation off", which control.json
and the live state both follow, and a module the operator, `specfleet up` and the loop can all import."""
from __future__ import annotations

import doctest
import itertools
import subprocess
import sys

import pytest

from specfleet_api import fleet_spec as fs
from specfleet_api.live_state import KBounds

BASE = {"model": {"name": "m", "uri": "u"}, "draft": {"method": "ngram"},
        "speculation": {"kMin": 2, "kInitial": 3, "kMax": 8, "kPolicy": "adaptive", "tree": {"branching": 1, "depth": 0}},
        "quantization": "none", "dtype": "auto", "device": "auto"}
FALLBACKS = [None, {"enabled": True, "probeShare": 5}, {"enabled": True, "probeShare": 0}, {"enabled": False},
             {"enabled": True}]  # the last: the CRD's default share
CANARIES = [None, {"weight": 5, "overrides": {"speculation": {"kMin": 1, "kMax": 12}}},
            {"weight": 5, "overrides": {"draft": {"method": "none"}}}]
STATES = [fs.FleetState(), fs.FleetState(mode=fs.FALLBACK), fs.FleetState(fallback=("code",))]


def test_docstring_examples():
    assert doctest.testmod(fs).failed == 0


def _spec(fallback, canary, method="ngram"):
    out = {**BASE, "draft": {"method": method}}
    if fallback is not None:
        out["slo"] = {"fallback": fallback}
    if canary is not None:
        out["canary"] = canary
    return out


@pytest.mark.parametrize("fallback, canary, state, method",
                         list(itertools.product(FALLBACKS, CANARIES, STATES, ["ngram", "none"])))
def test_control_json_and_the_live_state_say_the_same_k_bounds(fallback, canary, state, method):
    """Both are written from one decision (docs/worker-contract.md): a worker that starts from
    control.json and then reads the live state must not see its K bounds move. They once
    disagreed in a whole-deployment fallback with probes (control.json kMax 0, the live state the
    spec's bounds, the probes' share read with two defaults)."""
    spec = _spec(fallback, canary, method)
    live = fs.live_state(spec, state)
    for role in live.k:
        control = fs.control_config(spec, state, role)
        assert KBounds(control["kMin"], control["kMax"]) == live.k[role] == fs.k_bounds(spec, state, role), role
        assert control["speculate"] == fs.speculates(spec, state, role)
    assert live.speculate == fs.speculates(spec, state)
    assert live.probe_share == fs.probe_share(spec)


def test_in_a_whole_deployment_fallback_the_probes_keep_the_bounds_and_nothing_else_does():
    probes = _spec({"enabled": True, "probeShare": 5}, None)
    assert fs.control_config(probes, fs.FleetState(mode=fs.FALLBACK)) == {"speculate": False, "kMin": 2, "kMax": 8}
    for no_probes in (_spec({"enabled": True, "probeShare": 0}, None), _spec({"enabled": False}, None),
                      _spec(None, None, method="none")):
        assert fs.k_bounds(no_probes, fs.FleetState(mode=fs.FALLBACK)) == KBounds(0, 0)
    # the CRD's default share (5) where the spec leaves it unset, as the SLO loop reads it
    from specfleet_control.slo import SloPolicy
    assert fs.probe_share(_spec({"enabled": True}, None)) == SloPolicy.from_spec(_spec({"enabled": True}, None)).probe_share


def test_the_module_imports_no_kopf_kubernetes_torch_nor_the_operator():
    code = ("import sys, specfleet_api.fleet_spec; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'kopf', 'kubernetes', 'torch', 'specfleet_operator', "
            "'specfleet_control', 'specfleet_local', 'redis', 'aiohttp'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
