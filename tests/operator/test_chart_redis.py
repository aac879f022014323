"""The chart's Redis: rendered by the real Helm engine in each mode, validated, restricted, its
password only ever in a Secret; and the rendered configuration started on a local redis-server."""
import base64
import contextlib
import dataclasses
import os
import pathlib
import re
import shutil
import signal
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
# The local redis-server starts in milliseconds and stops in milliseconds: seconds leave room for a
# machine many times slower.
START_S = STOP_S = 10
# The entrypoint compares the password file every ROTATE_S and sets a change with one redis-cli
# call (milliseconds): 50 periods leave room for a machine many times slower.
ROTATE_S = 0.2
ROTATED_S = 50 * ROTATE_S


def render(values, name="specfleet", chart=CHART):
    out = helm.Chart.load(str(chart)).render(values, name=name, namespace=NS, is_install=True)
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
    assert c["image"] == "docker.io/library/redis:7.2.16-alpine"
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


@dataclasses.dataclass
class Running:
    port: int
    mounts: dict[str, pathlib.Path]  # the container's mount paths -> where they are here
    proc: subprocess.Popen
    log_file: pathlib.Path

    @property
    def password_file(self) -> pathlib.Path:
        return self.mounts["/etc/redis/auth"] / "password"

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def client(self, password: str | None) -> redis.Redis:
        # no retries: a refused connection is an answer here (redis-py retries one for seconds)
        return redis.Redis(port=self.port, password=password, socket_timeout=2, socket_connect_timeout=2,
                           retry=None)


def launch(r, tmp_path, password, **env) -> Running:
    """Run the Redis container's command, the entrypoint from the rendered ConfigMap, with the local
    redis-server and redis-cli, its mounts moved under tmp_path through the environment it reads (the
    image's paths do not exist here); `env` adds REDIS_ROTATE_S, REDIS_CLI and the like."""
    (c,) = r["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    mounts = {m["mountPath"]: tmp_path / m["name"] for m in c["volumeMounts"]}
    for path in mounts.values():
        path.mkdir()
    (mounts["/etc/redis/auth"] / "password").write_text(password)

    def relocate(text):
        for path, local in sorted(mounts.items(), key=lambda m: -len(m[0])):
            text = text.replace(path, str(local))
        return text

    port = free_port()
    data = r["ConfigMap"]["data"]
    conf = relocate(data["redis.conf"]).replace("port 6379", f"port {port}").replace("bind * -::*", "bind 127.0.0.1")
    (mounts["/etc/redis/conf"] / "redis.conf").write_text(conf)
    (mounts["/etc/redis/conf"] / "entrypoint.sh").write_text(data["entrypoint.sh"])
    assert c["command"] == ["sh", "/etc/redis/conf/entrypoint.sh"]
    env = {"REDIS_SERVER": shutil.which("redis-server"), "REDIS_CLI": shutil.which("redis-cli"),
           "REDIS_CONF": str(mounts["/etc/redis/conf"] / "redis.conf"),
           "REDIS_PASSWORD_FILE": str(mounts["/etc/redis/auth"] / "password"),
           "REDIS_AUTH_CONF": str(mounts["/run/redis"] / "auth.conf"), "REDIS_PORT": str(port), **env}
    log_file = tmp_path / "redis.log"
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(["sh", relocate(c["command"][1])], env={**os.environ, **env}, stdout=log,
                                stderr=subprocess.STDOUT)
    return Running(port, mounts, proc, log_file)


@contextlib.contextmanager
def started(r, tmp_path, password, **env):
    """launch(), then wait until Redis answers; stopped on the way out."""
    running = launch(r, tmp_path, password, **env)
    proc = running.proc
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, running.log()[-2000:]
            assert time.monotonic() < deadline, f"the rendered Redis did not start within {START_S} s"
            try:
                running.client(None).ping()
                break  # up (and open to anyone: the test says so)
            except redis.AuthenticationError:
                break  # up, and asking for the password
            except redis.ConnectionError:
                time.sleep(0.05)
        yield running
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=STOP_S)


def wait_until(condition, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


def accepts(running, password) -> bool:
    try:
        return running.client(password).ping()
    except redis.AuthenticationError:
        return False


@pytest.mark.parametrize("password", ["plainAlnum0123456789abcdefABCDEF", 'with "quotes" \\ and spaces'])
def test_the_rendered_redis_starts_with_auth_on_a_real_server(tmp_path, password):
    r = redis_objects(render({}))
    with started(r, tmp_path, password) as running:
        anonymous = running.client(None)
        with pytest.raises(redis.AuthenticationError):
            anonymous.set("specfleet:v1:x", "1")
        with pytest.raises(redis.AuthenticationError):
            running.client("wrong").ping()
        client = running.client(password)
        assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
        assert client.config_get("maxmemory")["maxmemory"] == str(200 * 1024 * 1024)
        auth_file = running.mounts["/run/redis"] / "auth.conf"
        assert auth_file.stat().st_mode & 0o077 == 0  # the password file: the redis user's alone


def test_an_empty_password_file_stops_the_start_with_a_message(tmp_path):
    """Redis never starts without a password (requirepass "" would let anyone in)."""
    running = launch(redis_objects(render({})), tmp_path, "\n")
    assert running.proc.wait(timeout=STOP_S) == 1
    assert "no password in" in running.log() and "redis.auth.key" in running.log()


def test_a_rotated_password_is_set_live_and_the_old_one_refused(tmp_path):
    """The kubelet rewrites the mounted Secret's file; the entrypoint sets the new password in the
    running server (same run_id: no restart), with the password only ever in a file, stdin or
    REDISCLI_AUTH (a redis-cli wrapper records every command line it is given); an empty file keeps
    the password in force; SIGTERM stops the server and the entrypoint with it."""
    r = redis_objects(render({}))
    calls = tmp_path / "redis-cli-calls"
    cli = tmp_path / "redis-cli"
    cli.write_text(f'#!/bin/sh\nprintf \'%s auth=%s\\n\' "$*" "${{REDISCLI_AUTH:+env}}" >> {calls}\n'
                   f'exec {shutil.which("redis-cli")} "$@"\n')
    cli.chmod(0o755)
    old, new = "old0123456789abcdefABCDEF012345", 'new "rotated" \\ one'
    with started(r, tmp_path, old + "\n", REDIS_ROTATE_S=str(ROTATE_S), REDIS_CLI=str(cli)) as running:
        run_id = running.client(old).info("server")["run_id"]
        running.password_file.write_text("")
        wait_until(lambda: "keeping the password in force" in running.log(), ROTATED_S, "an empty file noticed")
        assert accepts(running, old)

        running.password_file.write_text(new + "\n")
        wait_until(lambda: accepts(running, new), ROTATED_S, "the rotated password accepted")
        assert not accepts(running, old)
        assert running.client(new).info("server")["run_id"] == run_id
        # then the entrypoint writes the new auth file and says so
        wait_until(lambda: "password rotated" in running.log(), ROTATED_S, "the rotation logged")
        auth_conf = (running.mounts["/run/redis"] / "auth.conf").read_text()
        assert auth_conf == 'requirepass "new \\"rotated\\" \\\\ one"\n'  # a restart keeps the new one
        called = calls.read_text()
        assert "CONFIG SET requirepass auth=env" in called
        assert old not in called and new not in called and "-a " not in called

        running.proc.send_signal(signal.SIGTERM)
        assert running.proc.wait(timeout=STOP_S) == 0, running.log()[-2000:]
        assert "Received SIGTERM" in running.log()
        with pytest.raises(redis.ConnectionError):  # redis-server went with it
            running.client(new).ping()


def test_past_maxmemory_only_keys_with_a_ttl_are_evicted(tmp_path):
    """One fleet's workers writing windows past maxmemory (with their TTL, as specfleet_worker.fleet
    writes them) evict windows, never any fleet's live state (no TTL)."""
    from specfleet_api.live_state import state_key, window_key

    r = redis_objects(render({"redis": {"maxMemory": "4mb"}}))
    with started(r, tmp_path, "pw") as running:
        client = running.client("pw")
        states = {state_key("team-a", f"fleet-{i}"): f'{{"version": {i}}}' for i in range(3)}
        for key, doc in states.items():
            client.set(key, doc)
        for batch in range(40):  # 40 MB of windows through a 4 MB Redis
            pipe = client.pipeline(transaction=False)
            for pod in range(1000):
                key = f"{window_key('team-b', 'noisy', 'stable')}:pod-{batch}-{pod}"
                pipe.hset(key, mapping={"chat": "x" * 1000})
                pipe.expire(key, 45)
            pipe.execute()
        assert client.info("stats")["evicted_keys"] > 10_000
        assert {key: client.get(key).decode() for key in states} == states


def test_the_entrypoint_defaults_are_the_containers_paths():
    """The paths the tests above pass by the environment default to the container's own: the
    Secret's item (a mount without subPath, so the kubelet's updates reach it), the config the
    ConfigMap mounts, the auth file redis.conf includes, the port the container exposes."""
    r = redis_objects(render({}))
    script = r["ConfigMap"]["data"]["entrypoint.sh"]
    assert script == (CHART / "files" / "redis-entrypoint.sh").read_text()
    defaults = dict(re.findall(r"\$\{(REDIS_\w+):-([^}]*)\}", script))
    pod = r["StatefulSet"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert not any("subPath" in m for m in c["volumeMounts"])
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    (auth,) = [v for v in pod["volumes"] if v["name"] == "auth"]
    (item,) = auth["secret"]["items"]
    assert defaults["REDIS_PASSWORD_FILE"] == f"{mounts['auth']}/{item['path']}"
    assert c["command"] == ["sh", f"{mounts['conf']}/entrypoint.sh"]
    assert defaults["REDIS_CONF"] == f"{mounts['conf']}/redis.conf"
    conf = r["ConfigMap"]["data"]["redis.conf"]
    assert f"include {defaults['REDIS_AUTH_CONF']}\n" in conf
    assert defaults["REDIS_AUTH_CONF"].startswith(mounts["run"] + "/")
    assert f"port {defaults['REDIS_PORT']}\n" in conf and c["ports"][0]["containerPort"] == int(defaults["REDIS_PORT"])
    assert (defaults["REDIS_SERVER"], defaults["REDIS_CLI"]) == ("redis-server", "redis-cli")  # the image's PATH


def annotation(values, chart=CHART):
    sts = redis_objects(render(values, chart=chart))["StatefulSet"]
    return sts["spec"]["template"]["metadata"]["annotations"]["checksum/config"]


def test_a_changed_config_or_entrypoint_restarts_redis_and_a_new_password_does_not(tmp_path):
    """The pod template's checksum follows redis.conf and the entrypoint (read once, at start), not
    the password (the generated one differs on each render here: nothing to look up)."""
    assert annotation({}) == annotation({})
    assert annotation({"redis": {"maxMemory": "100mb"}}) != annotation({})
    assert annotation({"redis": {"persistence": {"enabled": True}}}) != annotation({})
    chart = tmp_path / "specfleet"
    shutil.copytree(CHART, chart)
    entrypoint = chart / "files" / "redis-entrypoint.sh"
    entrypoint.write_text(entrypoint.read_text().replace("rotate_s=${REDIS_ROTATE_S:-5}", "rotate_s=${REDIS_ROTATE_S:-6}"))
    assert annotation({}, chart=chart) != annotation({})


@pytest.mark.parametrize("release", ["r" * 40, "team-inference-production-eu-west-specfleet", "s" * 53])
def test_the_statefulset_name_leaves_room_for_the_revision_hash(release):
    """The controller labels each pod controller-revision-hash=<StatefulSet>-<10 characters>; past 63
    characters the label is invalid and the pod is never created. Helm's longest release name is 53."""
    r = redis_objects(render({}, name=release))
    name = r["StatefulSet"]["metadata"]["name"]
    assert name.endswith("-redis") and len(f"{name}-{'0' * 10}") <= 63
    assert {o["metadata"]["name"] for o in r.values()} == {name}
    assert r["StatefulSet"]["spec"]["serviceName"] == name


def test_the_notes_link_the_examples_of_this_version():
    out = helm.Chart.load(str(CHART)).render({}, name="specfleet", namespace=NS, is_install=True)
    notes = next(t for p, t in out.items() if p.endswith("NOTES.txt"))
    (link,) = re.findall(r"https://raw\.githubusercontent\.com/\S+", notes)
    app_version = helm.Chart.load(str(CHART)).metadata["appVersion"]
    owner_repo, ref, path = re.match(r"https://raw\.githubusercontent\.com/([^/]+/[^/]+)/([^/]+)/(.+)", link).groups()
    assert (owner_repo, ref) == ("specfleet/specfleet", f"v{app_version}")  # a tag, not a branch that moves
    assert (ROOT / path).is_file()


@pytest.mark.parametrize("path", sorted((CHART / "ci").glob("*-values.yaml")), ids=lambda p: p.name)
def test_every_ci_values_file_renders_the_redis_it_asks_for(path):
    values = yaml.safe_load(path.read_text()) or {}
    r = redis_objects(render(values))
    builtin = (values.get("redis") or {}).get("external", {}).get("url") is None
    assert bool(r) == builtin
    if builtin:
        assert len(r["StatefulSet"]["metadata"]["name"]) <= 52
        assert r["ConfigMap"]["data"]["entrypoint.sh"] == (CHART / "files" / "redis-entrypoint.sh").read_text()
        assert "maxmemory-policy volatile-lru\n" in r["ConfigMap"]["data"]["redis.conf"]
        (c,) = r["StatefulSet"]["spec"]["template"]["spec"]["containers"]
        assert c["image"].startswith("docker.io/library/redis")
        claims = r["StatefulSet"]["spec"].get("volumeClaimTemplates", [])
        assert len(claims) == int(bool(values.get("redis", {}).get("persistence", {}).get("enabled")))


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
    assert default >= 2  # every example serves on a default install (tests/operator/test_examples_default_install.py)


def test_the_operator_reads_the_admin_password_from_the_mounted_file(tmp_path):
    """--redis-url and --redis-password-file become the fleets' default Redis the handlers get."""
    from specfleet_operator.redis_state import DefaultRedis

    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    options = parse_args(["--redis-url", "redis://h:6379/0", "--redis-password-file", str(secret)])
    default = options.default_redis()
    assert default == DefaultRedis("redis://h:6379/0", "s3cret", str(secret))
    secret.write_text("rotated\n")  # the kubelet rewrote the mounted Secret: the next refresh takes it
    assert default.refresh() and default.password == "rotated" and not default.refresh()
    assert parse_args([]).default_redis() is None
    with pytest.raises(OSError, match="nowhere"):
        parse_args(["--redis-url", "redis://h:6379/0", "--redis-password-file", str(tmp_path / "nowhere")]
                   ).default_redis()
