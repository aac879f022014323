"""`promtool test rules` on the alerts as shipped: the chart's PrometheusRule (rendered by the real
Helm engine) and the operator's per-fleet one (manifests.prometheus_rule for one SDD, of either
engine), on series shaped like the workers', the vLLM pools' and the operator's scrapes. Each must
fire after a drop, stay firing while alpha stays low, resolve after recovery; fire on a speedup below
one and on alpha under its floor; stay quiet on a healthy fleet and on too little data. A missing
promtool fails, never skips. That vLLM exports the counters its rule reads is checked against the
vLLM in .venv-vllm (marker vllm)."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import textwrap

import helm_python as helm
import pytest
import yaml
from specfleet_operator import manifests
from specfleet_operator.spec import with_defaults

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 60
NS, NAME = "ml", "chat"
# what a ServiceMonitor scrape of a stable worker pod adds to its series (podTargetLabels)
TARGET = f'namespace="{NS}", serving_specfleet_dev_deployment="{NAME}", serving_specfleet_dev_role="stable", model="m"'
FLEET = {"namespace": NS, "serving_specfleet_dev_deployment": NAME, "sdd_namespace": NS, "sdd_name": NAME,
         "severity": "warning"}
MINUTES = 240


def chart_groups():
    out = helm.Chart.load(str(ROOT / "charts" / "specfleet")).render(
        {"prometheusRule": {"enabled": True}}, name="specfleet", namespace="monitoring", is_install=True)
    docs = [d for p, t in out.items() if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return rule["spec"]["groups"]


def operator_groups(**over):
    sdd = {"metadata": {"name": NAME, "namespace": NS, "uid": "u"}}
    spec = with_defaults({"model": {"name": "m", "uri": "/m"}, "replicas": 1,
                          "observability": {"prometheusRule": {"enabled": True}}, **over})
    return manifests.prometheus_rule(sdd, spec)["spec"]["groups"]


def vllm_groups():
    return operator_groups(engine={"name": "vllm"}, speculation={"kPolicy": "fixed", "kInitial": 4, "kMax": 4})


SOURCES = {"chart": chart_groups, "operator": operator_groups, "operator-vllm": vllm_groups}
#: The alerts of each source: the chart's cover both engines' fleets; the operator's, its fleet's engine.
ALERTS = {"chart": (*manifests.ENGINE_ALERTS["specfleet"], manifests.ALERT_VLLM_ALPHA),
          "operator": manifests.ENGINE_ALERTS["specfleet"], "operator-vllm": manifests.ENGINE_ALERTS["vllm"]}


def worker(alpha_by_type, drafted="0+1000x240", busy="0+60x240", plain="0+90x240"):
    """Input series of one stable worker: alpha per prompt type, and its counters."""
    series = [{"series": f'spec_decode_acceptance_rate{{{TARGET}, prompt_type="{t}"}}', "values": v}
              for t, v in alpha_by_type.items()]
    series += [{"series": f"spec_decode_num_draft_tokens_total{{{TARGET}}}", "values": drafted},
               {"series": f"spec_decode_busy_seconds_total{{{TARGET}}}", "values": busy},
               {"series": f"spec_decode_plain_equivalent_seconds_total{{{TARGET}}}", "values": plain},
               {"series": f"spec_decode_draft_failures_total{{{TARGET}}}", "values": "0x240"},
               # the canary arm is the canary analysis' business, not these alerts'
               {"series": f'spec_decode_acceptance_rate{{{TARGET.replace("stable", "canary")}, prompt_type="chat"}}',
                "values": "0.01x240"}]
    return series


def counter(per_minute):
    """A counter's values, one a minute, from its increase in each minute."""
    total, out = 0.0, ["0"]
    for step in per_minute:
        total += step
        out.append(f"{total:g}")
    return " ".join(out)


def vllm_pool(method, alpha, drafted=1000, role="stable"):
    """The two counters the vLLM rule reads, as a scrape of one pool's server leaves them
    (podTargetLabels add the fleet, arm and method; vLLM labels model_name and engine): `alpha`, the
    share of each minute's `drafted` tokens accepted, a number or one per minute."""
    target = (f'namespace="{NS}", serving_specfleet_dev_deployment="{NAME}", serving_specfleet_dev_role="{role}", '
              f'serving_specfleet_dev_method="{method}", model_name="m", engine="0", pod="{NAME}--{method}-0"')
    alphas = alpha if isinstance(alpha, list) else [alpha] * MINUTES
    return [{"series": f"{manifests.VLLM_DRAFTED}{{{target}}}", "values": counter([drafted] * MINUTES)},
            {"series": f"{manifests.VLLM_ACCEPTED}{{{target}}}", "values": counter([a * drafted for a in alphas])}]


def vllm_cases(rules):
    """A vLLM fleet's pools: ngram's acceptance falls from 0.6 to 0.2 at minute 90 for 55 minutes;
    eagle's sits under the floor in one case; a canary pool far under it and the too-little-data case
    never fire."""
    alpha = manifests.ALERT_VLLM_ALPHA
    pool = {**FLEET, "serving_specfleet_dev_method": "ngram"}
    canary = vllm_pool("ngram", 0.01, role="canary")
    return {
        "vllm-drop": case(rules, vllm_pool("ngram", [0.6] * 90 + [0.2] * 55 + [0.6] * 95) + vllm_pool("eagle", 0.5)
                          + canary, [(85, alpha, []), (97, alpha, [pool]), (120, alpha, [pool]), (144, alpha, [pool]),
                                     (150, alpha, []), (200, alpha, [])]),
        "vllm-floor": case(rules, vllm_pool("ngram", 0.5) + vllm_pool("eagle", 0.03) + canary, [
            (10, alpha, [{**pool, "serving_specfleet_dev_method": "eagle"}]),
            (200, alpha, [{**pool, "serving_specfleet_dev_method": "eagle"}])]),
        "vllm-too-little-data": case(rules, vllm_pool("eagle", 0.03, drafted=10) + canary, [
            (10, alpha, []), (100, alpha, [])]),
    }


def expected(rule, labels):
    """The alert promtool should report: the rule's annotations expanded on the series' labels."""
    def expand(text):
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)
    return {"exp_labels": {k: v for k, v in labels.items()},
            "exp_annotations": {k: expand(v) for k, v in rule.get("annotations", {}).items()}}


def case(rules, series, checks):
    """One promtool test: `checks` is [(minute, alertname, [labels of each alert firing then])]."""
    by_name = {r["alert"]: r for r in rules}
    return {"interval": "1m", "input_series": series,
            "alert_rule_test": [{"eval_time": f"{t}m", "alertname": name,
                                 "exp_alerts": [expected(by_name[name], labels) for labels in firing]}
                                for t, name, firing in checks]}


def cases(rules):
    code = {**FLEET, "prompt_type": "code"}
    alpha, speedup = manifests.ALERT_ALPHA, manifests.ALERT_SPEEDUP
    return {
        # code's alpha halves-and-more at minute 90 for 55 minutes (0.6 -> 0.2): fires, stays firing
        # all along (the old delta alert resolved after 7 minutes), resolves after recovery; chat,
        # beside it, stays healthy.
        "drop": case(rules, worker({"code": "0.6x89 0.2x54 0.6x95", "chat": "0.5x240"}), [
            (85, alpha, []), (97, alpha, [code]), (105, alpha, [code]), (120, alpha, [code]),
            (144, alpha, [code]), (150, alpha, []), (200, alpha, []), (120, speedup, [])]),
        # speculation slower than plain decoding (0.8x) for 30 minutes, then 1.5x
        "speedup": case(rules, worker({"chat": "0.5x240"}, plain="0+48x30 1530+90x209"), [
            (1, speedup, []), (10, speedup, [FLEET]), (30, speedup, [FLEET]), (40, speedup, []),
            (10, alpha, [])]),
        # alpha always under the floor: no baseline to drop from, the floor catches it
        "floor": case(rules, worker({"math": "0.03x240", "chat": "0.5x240"}), [
            (10, alpha, [{**FLEET, "prompt_type": "math"}]), (200, alpha, [{**FLEET, "prompt_type": "math"}])]),
        # the same collapse with 50 draft tokens a window: missing data, on which nothing is decided
        "too-little-data": case(rules, worker({"math": "0.03x240", "code": "0.6x89 0.2x150"},
                                              drafted="0+10x240", plain="0+30x240"), [
            (10, alpha, []), (100, alpha, []), (100, speedup, [])]),
        # healthy: nothing fires, ever; the operator's fallback gauge (scraped in its own namespace,
        # which no longer collides with the fleet's) fires the info alert
        "healthy": case(rules, worker({"code": "0.6x240", "chat": "0.45+0.0005x240"}) + [
            # a slow canary beside it (0.1x): its analysis' business, not these alerts'
            {"series": f"spec_decode_{counter}_total{{{TARGET.replace('stable', 'canary')}}}", "values": values}
            for counter, values in (("busy_seconds", "0+600x240"), ("plain_equivalent_seconds", "0+60x240"),
                                    ("num_draft_tokens", "0+1000x240"))] + [
            {"series": f'specfleet_fallback_active{{namespace="specfleet-system", job="specfleet", '
                       f'sdd_namespace="{NS}", sdd_name="{NAME}"}}', "values": "0x100 1x100"}], [
            (t, name, []) for t in (10, 60, 120, 239)
            for name in (alpha, speedup, manifests.ALERT_DRAFT_ERRORS)] + [
            (50, manifests.ALERT_FALLBACK, []),
            (150, manifests.ALERT_FALLBACK, [{"sdd_namespace": NS, "sdd_name": NAME, "severity": "info"}])]),
        "redis": case(rules, redis_series(), redis_checks()),
    }


def redis_series():
    """A fleet's routers and workers losing Redis, one by one, and Redis refusing its credentials:
    staleness is the seconds since the pod last read its live state (it polls every 0.5 s), growing
    by 60 a minute while Redis is away. Beside it a fleet without Redis, whose routers say 0."""
    router = f'namespace="{NS}", serving_specfleet_dev_deployment="{NAME}"'
    plain = f'namespace="{NS}", serving_specfleet_dev_deployment="plain", pod="plain--router-a"'
    return [
        # one router of two loses Redis at minute 30 and has it back at 50
        {"series": f'specfleet_router_redis_staleness_seconds{{{router}, pod="{NAME}--router-a"}}',
         "values": "0.3x29 0+60x19 0.3x40"},
        {"series": f'specfleet_router_redis_staleness_seconds{{{router}, pod="{NAME}--router-b"}}',
         "values": "0.3x90"},
        {"series": f"specfleet_router_redis_staleness_seconds{{{plain}}}", "values": "0x90"},
        {"series": f"specfleet_router_redis_connected{{{plain}}}", "values": "0x90"},
        # the stable worker misses three polls' worth of minutes (a blip: nothing fires); the canary
        # worker loses Redis at minute 60 and has it back at 80
        {"series": f"spec_decode_live_state_staleness_seconds{{{TARGET}}}", "values": "0x9 0+60x2 0x78"},
        {"series": f'spec_decode_live_state_staleness_seconds{{{TARGET.replace("stable", "canary")}}}',
         "values": "0x59 0+60x19 0x10"},
        # the operator's gauge: failed logins as the fleet's user in the last 2 minutes, a blip at 20,
        # then from 40 to 69; another fleet's stays 0
        {"series": f'specfleet_redis_auth_failures{{namespace="specfleet-system", job="specfleet", '
                   f'sdd_namespace="{NS}", sdd_name="{NAME}"}}', "values": "0x19 1x1 0x17 3x29 0x20"},
        {"series": f'specfleet_redis_auth_failures{{namespace="specfleet-system", job="specfleet", '
                   f'sdd_namespace="{NS}", sdd_name="plain"}}', "values": "0x90"},
    ]


def redis_checks():
    """Each fires after REDIS_STALE_S of staleness has held for REDIS_DOWN_FOR (the auth alert: from
    the first failed login, for 2m), stays firing while it lasts, resolves on return."""
    router, worker, auth = manifests.ALERT_ROUTER_REDIS, manifests.ALERT_WORKER_REDIS, manifests.ALERT_REDIS_AUTH
    fleet = [{**FLEET}]
    return ([(t, router, []) for t in (10, 31, 33)] + [(t, router, fleet) for t in (34, 49)] + [(51, router, [])]
            + [(t, worker, []) for t in (12, 14, 40, 63)] + [(t, worker, fleet) for t in (64, 79)]
            + [(80, worker, [])]
            + [(t, auth, []) for t in (21, 23, 41)]
            + [(t, auth, [{"sdd_namespace": NS, "sdd_name": NAME, "severity": "warning"}]) for t in (42, 69)]
            + [(71, auth, [])])


def promtool(*args, cwd):
    exe = shutil.which("promtool")
    assert exe, "promtool not found: run ./dev setup (installs Debian's prometheus package)"
    p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=cwd)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("source", SOURCES)
def test_rules_check_and_their_cases_pass_promtool(source, tmp_path):
    groups = SOURCES[source]()
    rules = groups[0]["rules"]
    assert tuple(r["alert"] for r in rules) == ALERTS[source]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    rc, out = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert rc == 0 and f"SUCCESS: {len(rules)} rules found" in out, out
    names = {r["alert"] for r in rules}
    tests = {**(cases(rules) if manifests.ALERT_ALPHA in names else {}),
             **(vllm_cases(rules) if manifests.ALERT_VLLM_ALPHA in names else {})}
    if source == "operator-vllm":  # its fallback alert, on the operator's gauge
        tests["vllm-fallback"] = case(rules, [
            {"series": f'specfleet_fallback_active{{namespace="specfleet-system", job="specfleet", '
                       f'sdd_namespace="{NS}", sdd_name="{NAME}"}}', "values": "0x100 1x100"}], [
            (50, manifests.ALERT_FALLBACK, []),
            (150, manifests.ALERT_FALLBACK, [{"sdd_namespace": NS, "sdd_name": NAME, "severity": "info"}])])
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": list(tests.values())}))
    rc, out = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert rc == 0 and "SUCCESS" in out, out


def test_promtool_test_rules_fails_on_a_wrong_expectation(tmp_path):
    """The guard: a case expecting the drop alert to resolve while alpha is still low fails, so a
    passing run above means the alert stayed firing."""
    groups = operator_groups()
    rules = groups[0]["rules"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    wrong = case(rules, worker({"code": "0.6x89 0.2x54 0.6x95"}), [(120, manifests.ALERT_ALPHA, [])])
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [wrong]}))
    rc, out = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert rc != 0 and "SpecDecodeAlphaBelowSLO" in out, out


def test_the_vllm_rule_fails_promtool_on_a_wrong_expectation(tmp_path):
    """The guard for the vLLM cases: expecting the ngram pool's alert to have resolved while its
    acceptance is still low fails."""
    groups = vllm_groups()
    rules = groups[0]["rules"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    wrong = case(rules, vllm_pool("ngram", [0.6] * 90 + [0.2] * 150), [(120, manifests.ALERT_VLLM_ALPHA, [])])
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [wrong]}))
    rc, out = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert rc != 0 and manifests.ALERT_VLLM_ALPHA in out, out


@pytest.mark.vllm
def test_vllm_exports_the_counters_the_vllm_rule_reads():
    """vLLM's own Prometheus logger for speculative decoding (.venv-vllm, `./dev setup --vllm`),
    driven with one step's stats, exposes manifests.VLLM_DRAFTED and VLLM_ACCEPTED under
    model_name: the names the rule reads are the names a pool's /metrics has."""
    python = ROOT / ".venv-vllm" / "bin" / "python"
    assert python.exists(), "no .venv-vllm: run ./dev setup --vllm"
    script = textwrap.dedent("""
        import types, prometheus_client
        from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats
        prom = SpecDecodingProm(types.SimpleNamespace(num_speculative_tokens=3), ["model_name", "engine"],
                                {0: ["m", "0"]})
        stats = SpecDecodingStats.new(3)
        stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=2)
        prom.observe(stats)
        print(prometheus_client.generate_latest().decode())
    """)
    p = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=TIMEOUT_S * 3)
    assert p.returncode == 0, p.stderr[-3000:]
    exposed = {line.split(" ")[0]: float(line.split(" ")[1]) for line in p.stdout.splitlines()
               if line and not line.startswith("#")}
    assert exposed[f'{manifests.VLLM_DRAFTED}{{engine="0",model_name="m"}}'] == 3.0, p.stdout
    assert exposed[f'{manifests.VLLM_ACCEPTED}{{engine="0",model_name="m"}}'] == 2.0, p.stdout
