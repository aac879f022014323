"""The chart's Redis: rendered by the real Helm engine in each mode, validated, restricted, its
password only ever in a Secret; and the rendered configuration started on a local redis-server."""
import base64
import contextlib
import os
import pathlib
import shutil
import subprocess
import time

import helm_python as helm
import kubernetes_validate
import pytest
import redis
import yaml

from specfleet_local.redis_server import free_port
from specfleet_operator.main import parse_args

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "specfleet"
NS = "specfleet-system"
MODES = {
    "default": {},
    "persistence": {"redis": {"persistence": {"enabled": True, "size": "5Gi", "storageClass": "fast"}}},
    "existing-secret": {"redis": {"auth": {"existingSecret": "my-redis", "key": "pw"}}},
    "external": {"redis": {"external": {"url": "rediss://redis.example.com:6380/2", "existingSecret": "managed",
                                        "key": "token"}}},
    "namespaced": {"watchNamespaces": ["team-a", "team-b"]},
}


def render(values):
    out = helm.Chart.load(str(CHART)).render(values, name="specfleet", namespace=NS, is_install=True)
    return [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def redis_objects(docs):
    return {d["kind"]: d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "redis"}


def operator_container(docs):
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    return dep["spec"]["template"]["spec"], dep["spec"]["template"]["spec"]["containers"][0]


def env_of(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def pod_specs(docs):
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in docs
            if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def assert_restricted(name, pod):
    """The restricted Pod Security Standard (v1.30), field by field."""
    sc = pod.get("securityContext", {})
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), name
    assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}
    for v in pod.get("volumes", []):
        assert set(v) - {"name"} <= allowed_volumes, (name, v)
    for c in pod.get("initContainers", []) + pod["containers"]:
        csc = c.get("securityContext", {})
        assert csc.get("allowPrivilegeEscalation") is False, (name, c["name"])
        assert csc.get("capabilities", {}).get("drop") == ["ALL"] and not csc["capabilities"].get("add"), name
        assert csc.get("runAsNonRoot", sc.get("runAsNonRoot")) is True, name
        assert csc.get("runAsUser", sc.get("runAsUser")) not in (0, None), name
        assert csc.get("readOnlyRootFilesystem") is True, name
        assert not csc.get("privileged") and "ports" not in c or all("hostPort" not in p for p in c["ports"])


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_renders_valid_objects_and_restricted_pods(mode):
    docs = render(MODES[mode])
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)
    for name, pod in pod_specs(docs):
        assert_restricted(name, pod)


def test_default_mode_runs_a_redis_with_a_generated_secret_and_gives_the_operator_its_url_and_file():
    docs = render({})
    r = redis_objects(docs)
    assert set(r) == {"Secret", "ConfigMap", "Service", "StatefulSet", "NetworkPolicy"}
    sts = r["StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "docker.io/library/redis:7.4.2-alpine"
    assert pod["securityContext"]["runAsUser"] == 999 and pod["automountServiceAccountToken"] is False
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/data"}
    assert "volumeClaimTemplates" not in sts["spec"]
    assert {"name": "data", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]
    assert "appendonly no" in r["ConfigMap"]["data"]["redis.conf"]
    password = base64.b64decode(r["Secret"]["data"]["password"]).decode()
    assert len(password) >= 32
    assert r["Service"]["spec"]["ports"][0]["port"] == 6379

    opod, op = operator_container(docs)
    env = env_of(op)
    assert env["SPECFLEET_REDIS_URL"] == "redis://specfleet-redis.specfleet-system.svc:6379/0"
    assert env["SPECFLEET_REDIS_PASSWORD_FILE"] == "/etc/specfleet/redis/password"
    (mount,) = [m for m in op["volumeMounts"] if m["mountPath"] == "/etc/specfleet/redis"]
    assert mount["readOnly"]
    (vol,) = [v for v in opod["volumes"] if v["name"] == mount["name"]]
    assert vol["secret"] == {"secretName": "specfleet-redis", "items": [{"key": "password", "path": "password"}]}
    # what the operator makes of it: the chart's own flags and env parse into its options
    os.environ.update({k: v for k, v in env.items() if isinstance(v, str)})
    try:
        options = parse_args(op["args"])
    finally:
        for k in ("SPECFLEET_REDIS_URL", "SPECFLEET_REDIS_PASSWORD_FILE"):
            os.environ.pop(k, None)
    assert options.redis_url == env["SPECFLEET_REDIS_URL"]
    assert options.redis_password_file == "/etc/specfleet/redis/password"


@pytest.mark.parametrize("mode", MODES)
def test_the_password_is_only_ever_in_the_secret(mode):
    docs = render(MODES[mode])
    secrets = [d for d in docs if d["kind"] == "Secret"]
    passwords = [base64.b64decode(v).decode() for s in secrets for v in s["data"].values()]
    assert len(passwords) == (1 if mode in ("default", "persistence", "namespaced") else 0)
    others = yaml.safe_dump_all([d for d in docs if d["kind"] != "Secret"])
    for p in passwords:
        assert p not in others
    for _, pod in pod_specs(docs):
        for c in pod["containers"]:
            for e in c.get("env", []):  # the only Redis settings in plain env: a URL without userinfo, a path
                if "value" in e and e["name"].startswith("SPECFLEET_REDIS"):
                    assert "@" not in e["value"], e
    assert not any(d["kind"] == "SpecDecodeDeployment" for d in docs)


def test_persistence_keeps_the_data_on_a_claim():
    r = redis_objects(render(MODES["persistence"]))
    (claim,) = r["StatefulSet"]["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi" and claim["spec"]["storageClassName"] == "fast"
    assert not any(v["name"] == "data" for v in r["StatefulSet"]["spec"]["template"]["spec"]["volumes"])
    assert "appendonly yes" in r["ConfigMap"]["data"]["redis.conf"]


def test_an_existing_secret_replaces_the_generated_one():
    docs = render(MODES["existing-secret"])
    r = redis_objects(docs)
    assert "Secret" not in r and "StatefulSet" in r
    (auth,) = [v for v in r["StatefulSet"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth"]
    assert auth["secret"]["secretName"] == "my-redis" and auth["secret"]["items"] == [{"key": "pw", "path": "password"}]
    opod, _ = operator_container(docs)
    (vol,) = [v for v in opod["volumes"] if v["name"] == "redis-password"]
    assert vol["secret"] == {"secretName": "my-redis", "items": [{"key": "pw", "path": "password"}]}


def test_external_mode_deploys_no_redis_and_names_the_managed_one():
    docs = render(MODES["external"])
    assert redis_objects(docs) == {}
    assert not any(d["kind"] == "StatefulSet" for d in docs)
    opod, op = operator_container(docs)
    env = env_of(op)
    assert env["SPECFLEET_REDIS_URL"] == "rediss://redis.example.com:6380/2"
    assert env["SPECFLEET_REDIS_PASSWORD_FILE"] == "/etc/specfleet/redis/password"
    (vol,) = [v for v in opod["volumes"] if v["name"] == "redis-password"]
    assert vol["secret"] == {"secretName": "managed", "items": [{"key": "token", "path": "password"}]}
    # a managed Redis without a password: no file, no mount
    docs = render({"redis": {"external": {"url": "redis://10.0.0.7:6379/0"}}})
    _, op = operator_container(docs)
    assert "SPECFLEET_REDIS_PASSWORD_FILE" not in env_of(op) and "volumeMounts" not in op
    # no Redis at all: the operator is given none
    _, op = operator_container(render({"redis": {"enabled": False}}))
    assert not any(e["name"].startswith("SPECFLEET_REDIS") for e in op["env"])


def test_a_password_in_the_url_is_refused_by_the_schema_and_the_operator():
    chart = helm.Chart.load(str(CHART))
    chart.validate_schema({"redis": {"external": {"url": "redis://redis.example.com:6379/0"}}})
    for bad in ("redis://:hunter2@redis.example.com:6379/0", "redis://user:pw@h:6379", "http://h:6379"):
        with pytest.raises(helm.HelmError):
            chart.validate_schema({"redis": {"external": {"url": bad}}})
    with pytest.raises(SystemExit):
        parse_args(["--redis-url", "redis://:hunter2@h:6379/0"])
    assert parse_args(["--redis-url", "redis://h:6379/0"]).redis_url == "redis://h:6379/0"


def test_the_network_policy_admits_only_the_operator_and_fleet_pods():
    for values, namespaces in (({}, [None]), (MODES["namespaced"], ["team-a", "team-b"])):
        np = redis_objects(render(values))["NetworkPolicy"]
        assert np["spec"]["policyTypes"] == ["Ingress"]
        (rule,) = np["spec"]["ingress"]
        assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]
        operator, *fleets = rule["from"]
        assert operator == {"podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "specfleet", "app.kubernetes.io/instance": "specfleet",
            "app.kubernetes.io/component": "operator"}}}
        assert [f["podSelector"] for f in fleets] == [{"matchLabels": {
            "app.kubernetes.io/managed-by": "specfleet-operator"}}] * len(namespaces)
        assert [f["namespaceSelector"].get("matchLabels", {}).get("kubernetes.io/metadata.name")
                for f in fleets] == namespaces


@contextlib.contextmanager
def started(pod, tmp_path, password):
    """Run the Redis container's own command line on the local redis-server, its mounts moved
    under tmp_path (the official image's paths do not exist here)."""
    (c,) = pod["containers"]
    mounts = {m["mountPath"]: tmp_path / m["name"] for m in c["volumeMounts"]}
    for path in mounts.values():
        path.mkdir()
    (mounts["/etc/redis/auth"] / "password").write_text(password)
    def relocate(text):
        for path, local in sorted(mounts.items(), key=lambda m: -len(m[0])):
            text = text.replace(path, str(local))
        return text

    port = free_port()
    conf = relocate(pod["_conf"]).replace("port 6379", f"port {port}").replace("bind * -::*", "bind 127.0.0.1")
    (mounts["/etc/redis/conf"] / "redis.conf").write_text(conf)
    assert c["command"][:2] == ["sh", "-c"]
    script = relocate(c["command"][2]).replace("exec redis-server", f"exec {shutil.which('redis-server')}")
    proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the rendered Redis did not start within 10 s"
            try:
                redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1).ping()
                break  # up (and open to anyone: the test says so)
            except redis.AuthenticationError:
                break  # up, and asking for the password
            except redis.ConnectionError:
                time.sleep(0.05)
        yield port, mounts
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("password", ["plainAlnum0123456789abcdefABCDEF", 'with "quotes" \\ and spaces'])
def test_the_rendered_redis_starts_with_auth_on_a_real_server(tmp_path, password):
    r = redis_objects(render({}))
    pod = dict(r["StatefulSet"]["spec"]["template"]["spec"], _conf=r["ConfigMap"]["data"]["redis.conf"])
    with started(pod, tmp_path, password) as (port, mounts):
        anonymous = redis.Redis(port=port, socket_timeout=2)
        with pytest.raises(redis.AuthenticationError):
            anonymous.set("specfleet:v1:x", "1")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="wrong", socket_timeout=2).ping()
        client = redis.Redis(port=port, password=password, socket_timeout=2)
        assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
        assert client.config_get("maxmemory")["maxmemory"] == str(200 * 1024 * 1024)
        auth_file = mounts["/run/redis"] / "auth.conf"
        assert auth_file.stat().st_mode & 0o077 == 0  # the password file: the redis user's alone


def test_the_examples_use_the_redis_the_chart_creates():
    """No example names a Redis that nothing creates: without spec.redis a fleet lives in the
    chart's (the operator is given its Service), and one that names its own keeps it in a Secret
    whose comment says how to make it."""
    docs = render({})
    service = redis_objects(docs)["Service"]["metadata"]
    (operator,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SPECFLEET_REDIS_URL"] == f"redis://{service['name']}.{service['namespace']}.svc:6379/0"
    own = default = 0
    for path in sorted((ROOT / "deploy" / "examples").glob("*.yaml")):
        text = path.read_text()
        for doc in yaml.safe_load_all(text):
            if (doc or {}).get("kind") != "SpecDecodeDeployment":
                continue
            r = doc["spec"].get("redis")
            if r is None:
                default += 1
                continue
            own += 1
            assert "url" not in r, (path.name, "a password-less URL that nothing creates")
            assert f"create secret generic {r['secretRef']['name']}" in text, path.name
    assert default >= 2 and own >= 1


def test_the_operator_reads_the_admin_password_from_the_mounted_file(tmp_path):
    """--redis-url and --redis-password-file become the fleets' default Redis the handlers get."""
    from specfleet_operator.redis_state import DefaultRedis

    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    options = parse_args(["--redis-url", "redis://h:6379/0", "--redis-password-file", str(secret)])
    assert options.default_redis() == DefaultRedis("redis://h:6379/0", "s3cret")
    assert parse_args([]).default_redis() is None
    with pytest.raises(OSError, match="nowhere"):
        parse_args(["--redis-url", "redis://h:6379/0", "--redis-password-file", str(tmp_path / "nowhere")]
                   ).default_redis()
