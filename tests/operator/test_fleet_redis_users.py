"""Each fleet in the default Redis has a user of its own (specfleet_api.redis_auth): the operator, as
the admin, creates it and the Secret its pods read it from (never reading a Secret back); with
fleet A's credentials the router reads A's live state, and nothing can forge it: A may not write
its own live state nor touch B's keys, and a client without credentials is refused."""
import base64

import pytest
import redis

from specfleet_api import redis_auth
from specfleet_api.live_state import LiveState, state_key, window_key
from specfleet_router.metrics import RouterMetrics
from specfleet_router.state import RedisState

from specfleet_operator import API_VERSION, KIND
from specfleet_operator.manifests import child_name, redis_secret_name, router_name
from specfleet_operator.redis_state import DefaultRedis
from specfleet_operator.testing import OperatorThread, ready, sdd_body, stored_live_state, wait_for

ADMIN = "admin-secret"


def secret_of(cluster, name):
    secret = cluster.live("v1", "secrets", "default", redis_secret_name(name))
    return secret and {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def redis_ready(cluster, name):
    sdd = cluster.live(API_VERSION, "specdecodedeployments", "default", name) or {}
    return any(c["type"] == "RedisReady" and c["status"] == "True"
               for c in (sdd.get("status") or {}).get("conditions", []))


def login(server, user, password):
    return server.client(username=user, password=password)


async def test_each_fleet_gets_a_user_that_can_read_its_state_and_forge_nothing(cluster, kube, redis_server,
                                                                                 monkeypatch):
    redis_server.client().config_set("requirepass", ADMIN)
    admin = redis_server.client(password=ADMIN)
    op = OperatorThread(cluster.endpoint, "op-a", loop_interval=0.3,
                        memo={"default_redis": DefaultRedis(redis_server.url, ADMIN)}).start()
    router = None
    try:
        for name in ("a", "b"):
            await kube.create(sdd_body(name, canary={"weight": 0.5}))
        for name in ("a", "b"):
            await wait_for(lambda: ready(cluster, name) and redis_ready(cluster, name), 30, f"{name} Ready")
        await wait_for(lambda: stored_live_state(admin, "default", "a"), 10, "a's live state")

        creds = secret_of(cluster, "a")
        sdd = cluster.live(API_VERSION, "specdecodedeployments", "default", "a")
        assert creds == {"username": "specfleet:default:a",
                         "password": redis_auth.fleet_password(ADMIN, "default", "a", sdd["metadata"]["uid"])}
        secret = cluster.live("v1", "secrets", "default", redis_secret_name("a"))
        assert [r["uid"] for r in secret["metadata"]["ownerReferences"]] == [sdd["metadata"]["uid"]]
        assert not [p for m, p in cluster.log if m == "GET" and "/secrets" in p]  # created, never read
        for deployment in (child_name("a", "stable"), child_name("a", "canary"), router_name("a")):
            env = {e["name"]: e for e in cluster.live("apps/v1", "deployments", "default", deployment)["spec"][
                "template"]["spec"]["containers"][0]["env"]}
            assert env["SPECFLEET_REDIS_URL"]["value"] == redis_server.url
            assert env["SPECFLEET_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": redis_secret_name("a"),
                                                                                   "key": "password"}
            assert env["SPECFLEET_REDIS_USERNAME"]["valueFrom"]["secretKeyRef"]["name"] == redis_secret_name("a")
            assert ADMIN not in str(env) and creds["password"] not in str(env)
        args = cluster.live("apps/v1", "deployments", "default", router_name("a"))["spec"]["template"]["spec"][
            "containers"][0]["args"]
        assert "--canary-weight" not in args  # the router follows Redis, not its flags

        # the router, with a's credentials in its environment as the Secret puts them there
        monkeypatch.setenv("SPECFLEET_REDIS_USERNAME", creds["username"])
        monkeypatch.setenv("SPECFLEET_REDIS_PASSWORD", creds["password"])
        router = RedisState(redis_server.url, "default", "a", LiveState(), RouterMetrics())
        assert await router.poll_once() and router.current == stored_live_state(admin, "default", "a")

        a = login(redis_server, creds["username"], creds["password"])
        own_window = f"{window_key('default', 'a', 'stable')}:pod-0"
        assert a.hset(own_window, "chat", "{}") == 1 and a.expire(own_window, 30)
        forged = LiveState(version=10**6, canary_weight=100.0).to_json()
        for forge in (lambda: a.set(state_key("default", "a"), forged), lambda: a.delete(state_key("default", "a")),
                      lambda: a.get(state_key("default", "b")),
                      lambda: a.hset(f"{window_key('default', 'b', 'stable')}:pod-0", "chat", "{}"),
                      lambda: a.keys("*"), lambda: a.execute_command("ACL", "SETUSER", "me", "on", ">x", "+@all"),
                      lambda: a.config_set("requirepass", "")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                forge()
        assert stored_live_state(admin, "default", "a").canary_weight != 100.0
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis_server.client().get(state_key("default", "a"))  # no credentials
        with pytest.raises(redis.exceptions.AuthenticationError):
            login(redis_server, creds["username"], "guessed").get(state_key("default", "a"))
        b = secret_of(cluster, "b")
        assert b["password"] != creds["password"]
        with pytest.raises(redis.exceptions.NoPermissionError):
            login(redis_server, b["username"], b["password"]).get(state_key("default", "a"))

        await kube.delete(API_VERSION, KIND, "default", "a")
        await wait_for(lambda: admin.execute_command("ACL", "GETUSER", "specfleet:default:a") is None, 20,
                       "a's user deleted with the fleet")
        assert admin.execute_command("ACL", "GETUSER", "specfleet:default:b") is not None
    finally:
        if router is not None:
            await router.close()
        await op.stop_and_join()


async def test_a_redis_that_lost_its_users_gets_them_again(cluster, kube, redis_server):
    """A restarted Redis has no ACL users: the operator makes the fleet's again before it writes."""
    redis_server.client().config_set("requirepass", ADMIN)
    admin = redis_server.client(password=ADMIN)
    op = OperatorThread(cluster.endpoint, "op-a", loop_interval=0.3,
                        memo={"default_redis": DefaultRedis(redis_server.url, ADMIN)}).start()
    try:
        await kube.create(sdd_body("c"))
        await wait_for(lambda: redis_ready(cluster, "c"), 30, "RedisReady")
        admin.execute_command("ACL", "DELUSER", "specfleet:default:c")
        admin.delete(state_key("default", "c"))
        await wait_for(lambda: stored_live_state(admin, "default", "c"), 20, "the state written again")
        assert admin.execute_command("ACL", "GETUSER", "specfleet:default:c") is not None
    finally:
        await op.stop_and_join()
