"""A fleet's Redis, said once and truly: RedisReady with the reason (Unreachable, AuthFailed,
NoCredentials) and the host (never the password), Degraded while the live state cannot be written,
one Warning event as Redis goes away and one Normal event when it is back, however many ticks the
loop runs meanwhile (no NoDecision event a tick)."""
import asyncio
import base64
import dataclasses

from specfleet_local.redis_server import RedisServer, free_port

from specfleet_operator import API_VERSION, KIND
from specfleet_operator.manifests import child_name
from specfleet_operator.testing import OperatorThread, sdd_body, stored_live_state, wait_for

TICK_S = 0.2


def events(cluster, name, reason=None):
    return [e for e in cluster.all_live("v1", "events")
            if e.get("involvedObject", {}).get("name") == name and reason in (None, e.get("reason"))]


def condition(cluster, name, ctype):
    sdd = cluster.live(API_VERSION, "specdecodedeployments", "default", name) or {}
    return next((c for c in (sdd.get("status") or {}).get("conditions", []) if c["type"] == ctype), None)


def redis_is(cluster, name, status, reason=None):
    c = condition(cluster, name, "RedisReady")
    return c is not None and c["status"] == status and reason in (None, c["reason"]) and c


async def ticks(cluster, name, n):
    """Wait until the control loop ran `n` more ticks (each reads the stable Deployment)."""
    path = f"/deployments/{child_name(name, 'stable')}"
    start = cluster.writes("GET", path)
    await wait_for(lambda: cluster.writes("GET", path) >= start + 2 * n, 30, f"{n} control-loop ticks")


async def test_redis_absent_is_said_once_and_its_return_once(cluster, kube):
    port = free_port()
    op = OperatorThread(cluster.endpoint, "op-a", loop_interval=TICK_S).start()
    server = None
    try:
        await kube.create(sdd_body("away", redis={"url": f"redis://127.0.0.1:{port}/0"}))
        cond = await wait_for(lambda: redis_is(cluster, "away", "False", "Unreachable"), 20, "RedisReady False")
        assert f"127.0.0.1:{port}" in cond["message"] and "ConnectionError" in cond["message"]
        degraded = condition(cluster, "away", "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] == "RedisUnreachable"
        await ticks(cluster, "away", 8)
        assert len(events(cluster, "away", "RedisUnavailable")) == 1
        assert events(cluster, "away", "NoDecision") == []  # the condition says it, not an event a tick
        assert events(cluster, "away", "RedisUnavailable")[0]["type"] == "Warning"

        server = RedisServer(port=port).start()
        await wait_for(lambda: redis_is(cluster, "away", "True"), 30, "RedisReady True once Redis is there")
        assert condition(cluster, "away", "Degraded")["status"] == "False"
        await wait_for(lambda: stored_live_state(server.client(), "default", "away"), 10, "the live state written")
        await ticks(cluster, "away", 5)
        (back,) = events(cluster, "away", "RedisAvailable")
        assert back["type"] == "Normal" and len(events(cluster, "away", "RedisUnavailable")) == 1
    finally:
        await op.stop_and_join()
        if server is not None:
            server.stop()


def url_secret(url, name="team-redis"):
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": name, "namespace": "default"},
            "data": {"url": base64.b64encode(url.encode()).decode()}}


def reading_secrets(op):
    """The operator as `--read-redis-secrets` starts it (the Secret's namespace granted the read)."""
    op.options = dataclasses.replace(op.options, worker=dataclasses.replace(op.options.worker, read_redis_secrets=True))
    return op


async def test_a_wrong_password_is_auth_failed_and_never_shown(cluster, kube, redis_server):
    """The URL (password inside) in a Secret of spec.redis.secretRef, as a URL with a password must
    be (spec.redis.url refuses one): wrong, then put right in the Secret."""
    redis_server.client().config_set("requirepass", "right-one")
    host = f"{redis_server.host}:{redis_server.port}"
    await kube.create(url_secret(f"redis://:wrong-one@{host}/0"))
    op = reading_secrets(OperatorThread(cluster.endpoint, "op-a", loop_interval=TICK_S)).start()
    try:
        await kube.create(sdd_body("auth", redis={"secretRef": {"name": "team-redis"}}))
        cond = await wait_for(lambda: redis_is(cluster, "auth", "False", "AuthFailed"), 20, "RedisReady AuthFailed")
        assert host in cond["message"] and "wrong-one" not in cond["message"]
        assert condition(cluster, "auth", "Degraded")["reason"] == "RedisAuthFailed"
        await ticks(cluster, "auth", 6)
        (warning,) = events(cluster, "auth", "RedisUnavailable")
        assert "wrong-one" not in warning["message"] and events(cluster, "auth", "NoDecision") == []

        await kube.patch("v1", "Secret", "default", "team-redis",
                         {"data": url_secret(f"redis://:right-one@{host}/0")["data"]})
        await wait_for(lambda: redis_is(cluster, "auth", "True"), 30, "RedisReady True with the right password")
        await ticks(cluster, "auth", 4)
        assert len(events(cluster, "auth", "RedisAvailable")) == 1
        assert len(events(cluster, "auth", "RedisUnavailable")) == 1
        assert stored_live_state(redis_server.client(password="right-one"), "default", "auth") is not None
    finally:
        await op.stop_and_join()


async def test_a_secret_read_the_cluster_refuses_names_the_grant_that_lets_it():
    """RBAC refuses the operator's read (the chart grants none): the status says which Role grants it."""
    from specfleet_operator import manifests, redis_state
    from specfleet_operator.kube import ApiError

    class Refusing:
        async def get(self, *args):
            raise ApiError(403, "Forbidden", "secrets \"team-redis\" is forbidden", "Secret team-redis")

    target, health = await redis_state.resolve(Refusing(), manifests.Settings(read_redis_secrets=True), None,
                                               sdd_body("t", namespace="team-a"),
                                               {"redis": {"secretRef": {"name": "team-redis"}}})
    assert target is None and health.reason == "NoCredentials"
    assert "kubectl -n team-a create role" in health.message and "--resource-name=team-redis" in health.message


async def test_a_secret_the_operator_may_not_read_is_no_credentials(cluster, kube):
    op = OperatorThread(cluster.endpoint, "op-a", loop_interval=TICK_S).start()
    try:
        await kube.create(sdd_body("hidden", redis={"secretRef": {"name": "managed-redis"}}))
        cond = await wait_for(lambda: redis_is(cluster, "hidden", "False", "NoCredentials"), 20, "NoCredentials")
        assert "managed-redis" in cond["message"] and "readRedisSecrets" in cond["message"]
        assert condition(cluster, "hidden", "Degraded")["status"] == "True"
        await ticks(cluster, "hidden", 6)
        assert len(events(cluster, "hidden", "RedisUnavailable")) == 1
    finally:
        await op.stop_and_join()


async def test_a_fleet_without_redis_has_no_redis_condition(cluster, kube):
    op = OperatorThread(cluster.endpoint, "op-a", loop_interval=TICK_S).start()
    try:
        await kube.create(sdd_body("plain"))
        await wait_for(lambda: condition(cluster, "plain", "Ready"), 20, "a status")
        await ticks(cluster, "plain", 3)
        assert condition(cluster, "plain", "RedisReady") is None
        assert condition(cluster, "plain", "Degraded")["status"] == "False"
        await asyncio.sleep(0)
    finally:
        await op.stop_and_join()
