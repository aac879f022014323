"""The Alertmanager receiver: webhook posts (payload v4, as Alertmanager sends them) to the running
operator HTTP server, behind a bearer token, into the AlertInbox the control loop reads; and a real
Alertmanager (Debian's prometheus-alertmanager, which ./dev setup installs: missing, the test fails)
delivering to it with the receiver config docs/alerts.md gives."""
from __future__ import annotations

import asyncio
import copy
import json
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml
from prometheus_client import REGISTRY
from specfleet_control.loop import Memory, tick
from specfleet_control.observe import Observation
from specfleet_control.slo import SloPolicy
from specfleet_operator import manifests
from specfleet_operator.alerts import AlertInbox, BearerToken, PayloadError, parse
from specfleet_operator.health import AlertReceiver, Heartbeat, serve
from specfleet_operator.testing import wait_for as async_wait_for
from specfleet_worker.testing import wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 10
TOKEN = "s3cret-token"
STARTS = "2026-12-01T16:40:00.123456789Z"  # Alertmanager writes nanoseconds

# A post as Alertmanager's webhook_config sends it (prometheus.io/docs/alerting/latest/configuration/
# #webhook_config): one group, the chart's alpha alert on one prompt type, and the fallback info alert.
PAYLOAD = {
    "version": "4",
    "groupKey": '{}/{severity=~"warning|info"}:{alertname="SpecDecodeAlphaBelowSLO", sdd_name="chat", sdd_namespace="ml"}',
    "truncatedAlerts": 0,
    "status": "firing",
    "receiver": "specfleet",
    "groupLabels": {"alertname": "SpecDecodeAlphaBelowSLO", "sdd_namespace": "ml", "sdd_name": "chat"},
    "commonLabels": {"alertname": "SpecDecodeAlphaBelowSLO", "severity": "warning", "sdd_namespace": "ml",
                     "sdd_name": "chat", "namespace": "ml", "serving_specfleet_dev_deployment": "chat"},
    "commonAnnotations": {},
    "externalURL": "http://alertmanager.monitoring:9093",
    "alerts": [
        {"status": "firing",
         "labels": {"alertname": "SpecDecodeAlphaBelowSLO", "severity": "warning", "sdd_namespace": "ml",
                    "sdd_name": "chat", "namespace": "ml", "serving_specfleet_dev_deployment": "chat",
                    "prompt_type": "code"},
         "annotations": {"summary": "Alpha of prompt type code in ml/chat is below its SLO over 5m",
                         "description": "Alpha is under 0.05, or under (1 - 0.5) x its best 5m in the 1h before"},
         "startsAt": STARTS, "endsAt": "0001-01-01T00:00:00Z",
         "generatorURL": "http://prometheus:9090/graph?g0.expr=...", "fingerprint": "5b1c0a3e9f2d7a10"},
        {"status": "firing",
         "labels": {"alertname": "SpecDecodeSpeedupBelowSLO", "severity": "warning", "sdd_namespace": "ml",
                    "sdd_name": "chat", "namespace": "ml", "serving_specfleet_dev_deployment": "chat"},
         "annotations": {"summary": "Speculative decoding in ml/chat is below a 1x speedup over 5m"},
         "startsAt": "2026-12-01T16:41:00Z", "endsAt": "2026-12-01T16:49:00Z",
         "generatorURL": "http://prometheus:9090/graph?g0.expr=...", "fingerprint": "77aa01b2c3d4e5f6"},
    ],
}


def post(port, body, token=TOKEN, path="/alertmanager", content_type="application/json"):
    """(status, JSON answer) of a POST; a 4xx/5xx is an answer, not an error."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=TIMEOUT_S) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def refused(reason):
    return REGISTRY.get_sample_value("specfleet_alertmanager_refused_requests_total", {"reason": reason}) or 0.0


def received(status):
    return REGISTRY.get_sample_value("specfleet_alerts_received_total", {"status": status}) or 0.0


def start_server(tmp_path, namespaces=()):
    """The operator's HTTP server (as `specfleet operator` starts it), its token in a file,
    watching `namespaces` (empty: every namespace)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # a Secret key written with a newline still matches
    receiver = AlertReceiver(AlertInbox(), BearerToken(path=str(token_file)), threading.Event(),
                             namespaces=tuple(namespaces))
    receiver.leading.set()
    srv = serve(0, Heartbeat(), addr="127.0.0.1", alerts=receiver)
    srv.receiver, srv.token_file = receiver, token_file
    return srv


@pytest.fixture()
def server(tmp_path):
    srv = start_server(tmp_path)
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture()
def ml_server(tmp_path):
    """A receiver of an operator that watches only the namespace ml (`--namespace ml`)."""
    srv = start_server(tmp_path, ("ml",))
    yield srv
    srv.shutdown()
    srv.server_close()


def test_a_real_alertmanager_post_lands_in_the_inbox(server):
    port, inbox = server.server_port, server.receiver.inbox
    before = received("firing")
    status, answer = post(port, PAYLOAD)
    assert (status, answer) == (200, {"alerts": 2, "matched": 2, "replayed": 0})
    assert received("firing") == before + 2
    firing = inbox.firing("ml", "chat", now=time.time())
    assert [(a.alertname, a.prompt_type, a.fingerprint) for a in firing] == [
        (manifests.ALERT_ALPHA, "code", "5b1c0a3e9f2d7a10"), (manifests.ALERT_SPEEDUP, None, "77aa01b2c3d4e5f6")]
    assert firing[0].since == pytest.approx(1796143200.123456) and all(a.slo_miss for a in firing)
    assert firing[0].summary.startswith("Alpha of prompt type code")
    assert inbox.firing("ml", "other", now=time.time()) == [] and inbox.firing("team-b", "chat", time.time()) == []


def test_a_wrong_or_missing_token_is_refused_and_changes_nothing(server):
    port, inbox = server.server_port, server.receiver.inbox
    before = refused("unauthorized")
    for token in ("wrong", "", None, TOKEN + "x"):
        status, answer = post(port, PAYLOAD, token=token)
        assert status == 401 and "bearer token" in answer["error"], (token, answer)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/alertmanager", data=json.dumps(PAYLOAD).encode(),
                                 headers={"Authorization": f"Basic {TOKEN}"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=TIMEOUT_S)
    assert exc.value.code == 401 and exc.value.headers["WWW-Authenticate"].startswith("Bearer")
    assert refused("unauthorized") == before + 5
    assert inbox.firing("ml", "chat", now=time.time()) == []
    # the Secret rotated: the file is re-read, the old token no longer opens it
    server.token_file.write_text("rotated")
    assert post(port, PAYLOAD)[0] == 401
    assert post(port, PAYLOAD, token="rotated")[0] == 200


def test_resolved_removes_and_other_fleets_stay(server):
    port, inbox = server.server_port, server.receiver.inbox
    other = copy.deepcopy(PAYLOAD["alerts"][1])
    other["labels"]["sdd_name"], other["fingerprint"] = "summarize", "0f0f0f0f0f0f0f0f"
    assert post(port, {**PAYLOAD, "alerts": [*PAYLOAD["alerts"], other]})[0] == 200
    resolved = copy.deepcopy(PAYLOAD)
    resolved["status"] = "resolved"
    resolved["alerts"] = [{**resolved["alerts"][0], "status": "resolved", "endsAt": "2026-12-01T17:02:00Z"}]
    assert post(port, resolved) == (200, {"alerts": 1, "matched": 1, "replayed": 0})
    assert [a.alertname for a in inbox.firing("ml", "chat", now=time.time())] == [manifests.ALERT_SPEEDUP]
    assert [a.alertname for a in inbox.firing("ml", "summarize", now=time.time())] == [manifests.ALERT_SPEEDUP]


@pytest.mark.parametrize("body, names", [
    (b"{not json", "body: not JSON"),
    ([], "body: expected a JSON object"),
    ({**PAYLOAD, "version": "3"}, "version: expected \"4\""),
    ({**PAYLOAD, "alerts": {"a": 1}}, "alerts: expected a list"),
    ({**PAYLOAD, "alerts": [{**PAYLOAD["alerts"][0], "status": "pending"}]}, "alerts[0].status"),
    ({**PAYLOAD, "alerts": [PAYLOAD["alerts"][0], {**PAYLOAD["alerts"][1], "labels": {"a": 1}}]}, "alerts[1].labels"),
    ({**PAYLOAD, "alerts": [{**PAYLOAD["alerts"][0], "startsAt": "yesterday"}]}, "alerts[0].startsAt"),
    ({**PAYLOAD, "alerts": [{**PAYLOAD["alerts"][0], "startsAt": "2026-12-01T16:40:00"}]}, "no time zone"),
    ({**PAYLOAD, "alerts": [{**PAYLOAD["alerts"][0], "fingerprint": ""}]}, "alerts[0].fingerprint"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_malformed_post_is_400_naming_what_is_wrong_and_the_server_keeps_serving(server, body, names):
    port, inbox = server.server_port, server.receiver.inbox
    before = refused("malformed")
    status, answer = post(port, body)
    assert status == 400 and names in answer["error"], answer
    assert refused("malformed") == before + 1
    assert inbox.firing("ml", "chat", now=time.time()) == []  # nothing of a bad post is taken
    assert get(port, "/healthz") == (200, "ok\n")
    assert post(port, PAYLOAD)[0] == 200


def test_an_empty_body_is_400(server):
    status, answer = post(server.server_port, b"")
    assert status == 400 and "Content-Length" in answer["error"]


def test_without_a_token_the_receiver_is_off_never_open(tmp_path):
    receiver = AlertReceiver(AlertInbox(), BearerToken(path=str(tmp_path / "absent")))
    srv = serve(0, Heartbeat(), addr="127.0.0.1", alerts=receiver)
    plain = serve(0, Heartbeat(), addr="127.0.0.1")  # no receiver at all
    try:
        for port in (srv.server_port, plain.server_port):
            for token in (None, "", "anything"):
                status, answer = post(port, PAYLOAD, token=token)
                assert status == 404 and "receiver is off" in answer["error"]
        assert receiver.inbox.firing("ml", "chat", now=time.time()) == []
        (tmp_path / "absent").write_text(TOKEN)  # the Secret appears: on, without a restart
        assert post(srv.server_port, PAYLOAD)[0] == 200
    finally:
        for s in (srv, plain):
            s.shutdown()
            s.server_close()


def test_a_standby_answers_503_so_that_alertmanager_retries_the_leader(server):
    server.receiver.leading.clear()
    status, answer = post(server.server_port, PAYLOAD)
    assert status == 503 and "standby" in answer["error"]
    assert server.receiver.inbox.firing("ml", "chat", now=time.time()) == []
    assert post(server.server_port, PAYLOAD, token="wrong")[0] == 401  # the token is checked first
    server.receiver.leading.set()
    assert post(server.server_port, PAYLOAD)[0] == 200


def test_firing_alerts_expire_without_resends_and_keep_a_later_endsAt():
    inbox = AlertInbox(ttl_s=300)
    alerts = parse(json.dumps(PAYLOAD).encode())
    received_at = 1796143300.0
    inbox.record(alerts, now=received_at)
    assert len(inbox.firing("ml", "chat", now=received_at + 299)) == 2
    # the alpha alert (no endsAt) is gone after the TTL; the speedup alert's endsAt (16:49) is later
    assert [a.alertname for a in inbox.firing("ml", "chat", now=received_at + 301)] == [manifests.ALERT_SPEEDUP]
    assert inbox.firing("ml", "chat", now=1796143740.0 + 1) == []
    inbox.record(alerts, now=received_at + 1000)  # resent: firing again
    assert len(inbox.firing("ml", "chat", now=received_at + 1001)) == 2


def test_a_vllm_pools_alpha_alert_falls_the_whole_fleet_back_and_the_documented_route_sends_it():
    """SpecDecodeVLLMAlphaBelowSLO names a pool (its draft method), not a prompt type: an SLO miss of the
    whole fleet; and the Alertmanager route docs/alerts.md gives matches every SLO alert."""
    from specfleet_operator.alerts import SLO_ALERTS
    labels = {"alertname": manifests.ALERT_VLLM_ALPHA, "severity": "warning", "sdd_namespace": "ml",
              "sdd_name": "chat", "namespace": "ml", "serving_specfleet_dev_deployment": "chat",
              manifests.PROM_LABEL_METHOD: "ngram"}
    body = {"version": "4", "alerts": [{"status": "firing", "labels": labels, "startsAt": STARTS,
                                        "fingerprint": "0a1b2c3d4e5f6a7b"}]}
    inbox = AlertInbox()
    assert inbox.record(parse(json.dumps(body).encode()), now=0).matched == 1
    (miss,) = inbox.slo_misses("ml", "chat", now=1)
    assert (miss.name, miss.prompt_type) == (manifests.ALERT_VLLM_ALPHA, None)
    moved = tick(Observation().with_alerts((miss,)), Memory(), SloPolicy(), 1.0)
    assert moved.memory.whole
    (route,) = docs_receiver_config()["route"]["routes"]
    (matcher,) = route["matchers"]
    pattern = re.fullmatch(r'alertname=~"(.*)"', matcher).group(1)
    assert {a for a in SLO_ALERTS if re.fullmatch(pattern, a)} == SLO_ALERTS


def test_alerts_name_their_fleet_by_labels_that_survive_scraping():
    def alert(labels):
        body = {"version": "4", "alerts": [{"status": "firing", "labels": {"alertname": "X", **labels},
                                            "startsAt": STARTS, "fingerprint": json.dumps(labels)}]}
        return parse(json.dumps(body).encode())
    inbox = AlertInbox()
    long_name = "llama-3.1-8b-instruct-" + "x" * 60  # the workers' pod label shortens it
    assert inbox.record(alert({"sdd_namespace": "ml", "sdd_name": "chat"}), now=0).matched == 1
    # the operator's gauge before sdd_* (its namespace label renamed by the scrape), and a rule on the pod label
    assert inbox.record(alert({"exported_namespace": "ml", "serving_specfleet_dev_deployment": "old"}), now=0).matched == 1
    assert inbox.record(alert({"sdd_namespace": "ml", "sdd_name": manifests.label_value(long_name)}), now=0).matched == 1
    assert inbox.record(alert({"namespace": "ml", "alertname": "Watchdog"}), now=0).matched == 0  # names no fleet
    assert [len(inbox.firing("ml", n, now=1)) for n in ("chat", "old", long_name, "Watchdog")] == [1, 1, 1, 0]
    with pytest.raises(PayloadError, match=r"alerts\[0\].labels"):
        parse(json.dumps({"version": "4", "alerts": [{"status": "firing", "startsAt": STARTS}]}).encode())


def test_the_operator_command_serves_the_receiver_from_its_token_file(tmp_path):
    """`specfleet operator` itself (kopf replaced by waiting, as in tests/metrics/test_promtool.py):
    the flag's file opens /alertmanager on the metrics port, and the post is counted on /metrics."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "token").write_text(TOKEN)
    code = ("import asyncio, sys; import specfleet_operator.main as m\n"
            "async def lead(options, stop, leading): leading.set(); await stop.wait(); return 0\n"
            "m.operate = lead\n"
            "sys.exit(m.run(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", code, "--no-leader-election", "--metrics-port", str(port),
                             "--alertmanager-token-file", str(tmp_path / "token"), "--namespace", "ml"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    def accepted():
        assert proc.poll() is None, "the operator exited before its metrics port answered"
        try:
            return post(port, PAYLOAD)[0] == 200
        except OSError:
            return False
    try:
        wait_for(accepted, TIMEOUT_S, f"a 200 from /alertmanager on port {port}", poll_s=0.05)
        assert post(port, PAYLOAD, token="wrong")[0] == 401
        elsewhere = copy.deepcopy(PAYLOAD)
        elsewhere["alerts"][0]["labels"]["sdd_namespace"] = "team-b"
        assert post(port, elsewhere)[0] == 403  # --namespace ml: the receiver watches what kopf watches
        _, metrics = get(port, "/metrics")
        assert 'specfleet_alerts_received_total{status="firing"} 2.0' in metrics
        assert 'specfleet_alertmanager_refused_requests_total{reason="unauthorized"} 1.0' in metrics
        assert 'specfleet_alertmanager_refused_requests_total{reason="namespace"} 1.0' in metrics
    finally:
        proc.kill()
        proc.wait(TIMEOUT_S)


def test_alerts_for_a_namespace_not_watched_are_refused_naming_it(ml_server):
    port, inbox = ml_server.server_port, ml_server.receiver.inbox
    before = refused("namespace")
    other = copy.deepcopy(PAYLOAD)
    other["alerts"][1]["labels"]["sdd_namespace"] = "team-b"
    status, answer = post(port, other)
    assert status == 403 and "alerts[1] is for team-b/chat" in answer["error"], answer
    assert "watches only the namespaces ml" in answer["error"]
    assert refused("namespace") == before + 1
    assert inbox.firing("ml", "chat", now=time.time()) == []  # nothing of the post is taken
    assert post(port, PAYLOAD)[0] == 200  # its own namespace's alerts act
    assert len(inbox.firing("ml", "chat", now=time.time())) == 2


def test_every_namespace_is_watched_without_a_namespace_list(server):
    other = copy.deepcopy(PAYLOAD)
    other["alerts"][1]["labels"]["sdd_namespace"] = "team-b"
    assert post(server.server_port, other)[0] == 200


def test_a_replayed_alert_is_a_no_op(server):
    """A firing post of an episode (fingerprint, startsAt) already resolved changes nothing; so does
    one older than the episode firing now; a new episode (a later startsAt) fires."""
    port, inbox = server.server_port, server.receiver.inbox
    alpha = {**PAYLOAD, "alerts": [PAYLOAD["alerts"][0]]}
    assert post(port, alpha) == (200, {"alerts": 1, "matched": 1, "replayed": 0})
    resolved = copy.deepcopy(alpha)
    resolved["alerts"][0].update(status="resolved", endsAt="2026-12-01T17:02:00Z")
    assert post(port, resolved)[0] == 200 and inbox.firing("ml", "chat", now=time.time()) == []
    before = received("replayed")
    for _ in range(2):
        assert post(port, alpha) == (200, {"alerts": 1, "matched": 1, "replayed": 1})
    assert inbox.firing("ml", "chat", now=time.time()) == [] and received("replayed") == before + 2
    later = copy.deepcopy(alpha)
    later["alerts"][0]["startsAt"] = "2026-12-01T18:00:00Z"
    assert post(port, later) == (200, {"alerts": 1, "matched": 1, "replayed": 0})
    assert [a.since for a in inbox.firing("ml", "chat", now=time.time())] == [1796148000.0]
    assert post(port, alpha)[1]["replayed"] == 1  # the older episode, again: the later one stays
    assert [a.since for a in inbox.firing("ml", "chat", now=time.time())] == [1796148000.0]
    # a resolution of the older episode never ends the later one
    assert post(port, resolved)[0] == 200 and len(inbox.firing("ml", "chat", now=time.time())) == 1


def test_a_resend_of_a_firing_alert_keeps_it_alive_and_changes_nothing_else():
    """Alertmanager resends a firing alert every repeat_interval: the same episode again is no replay
    of a resolved one; it keeps the alert from expiring, with the same since."""
    inbox = AlertInbox(ttl_s=300)
    alerts = parse(json.dumps({**PAYLOAD, "alerts": [PAYLOAD["alerts"][0]]}).encode())
    assert inbox.record(alerts, now=1000.0) == (1, 0)
    assert inbox.record(alerts, now=1250.0) == (1, 0)
    (a,) = inbox.firing("ml", "chat", now=1500.0)  # past the first post's TTL, within the resend's
    assert a.since == pytest.approx(1796143200.123456)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def docs_receiver_config():
    """The Alertmanager config docs/alerts.md gives (the block with `receivers:`)."""
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "alerts.md").read_text(), re.DOTALL)
    (block,) = [b for b in blocks if "receivers:" in b]
    return yaml.safe_load("\n".join(line[3:] for line in block.splitlines()))  # the list's indent


def alertmanager_post(port, alerts):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v2/alerts", data=json.dumps(alerts).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
        assert resp.status == 200


def test_a_real_alertmanager_delivers_firing_and_resolved_and_a_wrong_token_is_refused(ml_server, tmp_path):
    """Alertmanager, configured as docs/alerts.md says, delivers to an operator watching the namespace
    ml: its alerts for ml act; one for another namespace is refused (403); one sent with a wrong token
    too (401); and once resolved, a replay of what it posted changes nothing."""
    server = ml_server
    posted = []
    record = server.receiver.inbox.record
    server.receiver.inbox.record = lambda alerts, now=None: (posted.append(list(alerts)), record(alerts, now))[1]
    exe = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    assert exe, "alertmanager not found: run ./dev setup (installs Debian's prometheus-alertmanager)"
    # the documented receiver, pointed at this server, with its token file; one route with a wrong token
    config = docs_receiver_config()
    (route,) = config["route"]["routes"]
    route.update(group_wait="0s", group_interval="1s")
    (hook,) = config["receivers"][0]["webhook_configs"]
    hook["url"] = f"http://127.0.0.1:{server.server_port}/alertmanager"
    hook["http_config"]["authorization"]["credentials_file"] = str(server.token_file)
    wrong = copy.deepcopy(config["receivers"][0])
    wrong["name"] = "intruder"
    wrong["webhook_configs"][0]["http_config"]["authorization"] = {"type": "Bearer", "credentials": "guessed"}
    config["receivers"].append(wrong)
    config["route"] = {"receiver": "intruder", "group_wait": "0s", "group_interval": "1s",
                       "routes": [{**route, "matchers": [*route["matchers"], 'sdd_name!="intruder"'], "continue": False}]}
    (tmp_path / "am.yml").write_text(yaml.safe_dump(config))
    amtool = shutil.which("amtool")
    assert amtool, "amtool not found: run ./dev setup (installs Debian's prometheus-alertmanager)"
    check = subprocess.run([amtool, "check-config", str(tmp_path / "am.yml")], capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    am = subprocess.Popen([exe, f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path / 'data'}",
                           f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                          stdout=subprocess.DEVNULL, stderr=(tmp_path / "am.log").open("w"))
    inbox = server.receiver.inbox
    now = time.time()
    labels = {"alertname": manifests.ALERT_ALPHA, "severity": "warning", "sdd_namespace": "ml", "sdd_name": "chat",
              "prompt_type": "code"}
    alert = {"labels": labels, "annotations": {"summary": "alpha of code below its SLO"},
             "startsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - 60)),
             "generatorURL": "http://prometheus:9090/graph"}
    intruder = {**alert, "labels": {**labels, "sdd_name": "intruder"}}
    elsewhere = {**alert, "labels": {**labels, "sdd_namespace": "team-b"}}
    unauthorized, unwatched, replays = refused("unauthorized"), refused("namespace"), received("replayed")

    def up():
        assert am.poll() is None, f"alertmanager exited: {(tmp_path / 'am.log').read_text()}"
        try:
            return get(port, "/-/ready")[0] == 200
        except OSError:
            return False
    try:
        wait_for(up, 20, "alertmanager to be ready", poll_s=0.1)
        alertmanager_post(port, [alert, intruder, elsewhere])
        firing = wait_for(lambda: inbox.firing("ml", "chat", now=time.time()), 20,
                          "Alertmanager's webhook to reach the inbox", poll_s=0.1)
        assert [(a.alertname, a.prompt_type, a.slo_miss) for a in firing] == [(manifests.ALERT_ALPHA, "code", True)]
        # the same fallback: the loop, given what the inbox holds, takes prompt type code (only) off
        moved = tick(Observation().with_alerts(inbox.slo_misses("ml", "chat", time.time())), Memory(),
                     SloPolicy(), time.time())
        assert moved.memory.fallback_types() == ("code",) and not moved.memory.whole
        assert moved.events == (("FallbackEntered", f"prompt type code: speculation off: alert {manifests.ALERT_ALPHA} "
                                 "firing"),)
        wait_for(lambda: refused("unauthorized") > unauthorized, 20, "the wrong token to be refused", poll_s=0.1)
        assert inbox.firing("ml", "intruder", now=time.time()) == []
        assert tick(Observation().with_alerts(inbox.slo_misses("ml", "intruder", time.time())), Memory(),
                    SloPolicy(), time.time()).memory.fallback_types() == ()
        # resolved: Alertmanager's next notification of the group removes it
        alertmanager_post(port, [{**alert, "endsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1))}])
        wait_for(lambda: inbox.firing("ml", "chat", now=time.time()) == [], 20, "the resolved notification",
                 poll_s=0.1)
        # the namespace this operator does not watch: refused, nothing taken
        wait_for(lambda: refused("namespace") > unwatched, 20, "the alert for team-b to be refused", poll_s=0.1)
        assert inbox.firing("team-b", "chat", now=time.time()) == []
        # a replay of Alertmanager's firing post, after its resolution: a no-op
        (firing_alert,) = [a for alerts in posted for a in alerts if a.status == "firing"][:1]
        replay = {"version": "4", "status": "firing", "alerts": [{
            "status": "firing", "labels": firing_alert.labels, "annotations": firing_alert.annotations,
            "startsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(firing_alert.starts_at)),
            "endsAt": "0001-01-01T00:00:00Z", "fingerprint": firing_alert.fingerprint}]}
        assert post(server.server_port, replay) == (200, {"alerts": 1, "matched": 1, "replayed": 1})
        assert inbox.firing("ml", "chat", now=time.time()) == [] and received("replayed") == replays + 1
        assert get(server.server_port, "/healthz") == (200, "ok\n")
    finally:
        am.terminate()
        try:
            am.wait(TIMEOUT_S)
        except subprocess.TimeoutExpired:
            am.kill()
            am.wait(TIMEOUT_S)


async def test_the_control_loop_reads_the_inbox_the_receiver_writes(cluster, monkeypatch):
    """operate() hands Options.alerts (which `specfleet operator` serves on /alertmanager) to the
    handlers as memo.alerts."""
    import kopf
    from specfleet_operator import main

    seen = {}

    async def kopf_operator(*, memo, stop_flag, **kwargs):
        seen["memo"] = memo
        await stop_flag.wait()

    monkeypatch.setattr(kopf, "operator", kopf_operator)
    options = main.Options(leader_election=False)
    stop = threading.Event()
    task = asyncio.ensure_future(main.operate(options, connection=kopf.ConnectionInfo(server=cluster.endpoint),
                                              stop=stop))
    try:
        await async_wait_for(lambda: "memo" in seen, TIMEOUT_S, "kopf to start with the memo")
        assert seen["memo"].alerts is options.alerts
    finally:
        stop.set()
        assert await asyncio.wait_for(task, TIMEOUT_S) == 0
