"""Each fleet in the default Redis has a user of its own (specfleet_api.redis_auth): the operator, as
the admin, creates it and the Secret its pods read it from (never reading a Secret back); with
fleet A's credentials the router reads A's live state, and nothing can forge it: A may not write
its own live state nor touch B's keys, and a client without credentials is refused."""
import base64

import pytest
import redis

from specfleet_api import redis_auth
from specfleet_api.live_state import PREFIX, LiveState, state_key, window_key
from specfleet_api.windows import cluster_key, drift_key
from specfleet_local.state import gate_key, loop_key
from specfleet_router.metrics import RouterMetrics
from specfleet_router.state import RedisState

from specfleet_operator import API_VERSION, KIND
from specfleet_operator.manifests import child_name, router_name
from specfleet_operator.redis_state import DefaultRedis, credentials_name
from specfleet_operator.testing import OperatorThread, ready, sdd_body, stored_live_state, wait_for

ADMIN = "admin-secret"


def redis_secret_name(cluster, name, master=ADMIN):
    """The fleet's credentials Secret as the operator names it (from what only the master's holder knows)."""
    uid = cluster.live(API_VERSION, "specdecodedeployments", "default", name)["metadata"]["uid"]
    return credentials_name(name, redis_auth.fleet_username("default", name),
                            redis_auth.fleet_password(master, "default", name, uid))


def secret_of(cluster, name, master=ADMIN):
    secret = cluster.live("v1", "secrets", "default", redis_secret_name(cluster, name, master))
    return secret and {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def redis_ready(cluster, name):
    sdd = cluster.live(API_VERSION, "specdecodedeployments", "default", name) or {}
    return any(c["type"] == "RedisReady" and c["status"] == "True"
               for c in (sdd.get("status") or {}).get("conditions", []))


def login(server, user, password):
    return server.client(username=user, password=password)


# Fleets whose keys share a prefix: a name that extends another's (chat, chat2) and a namespace
# that extends another's (team, team-a). A key pattern widened to a prefix hands one the other's keys.
NEIGHBOURS = (("default", "chat"), ("default", "chat2"), ("team", "chat"), ("team-a", "chat"))


def fleet_keys(namespace, name):
    """A key of each kind a fleet's routers and workers touch, named by their writers' own functions."""
    return {"state": state_key(namespace, name),
            "window": f"{window_key(namespace, name, 'stable')}:pod-0",
            "worker": f"{PREFIX}{namespace}/{name}:worker:pod-0",  # specfleet_worker.fleet.FleetPublisher.key
            "clusters": cluster_key(namespace, name, "r1"),
            "drift": drift_key(namespace, name, "r1")}


def loop_keys(namespace, name):
    """The keys only the loop writes (`specfleet up`'s gate and memory): no fleet user's."""
    return [gate_key(namespace, name), loop_key(namespace, name)]


def allowed(call):
    """Whether Redis let the user's call through its ACL (it may still fail on the value, WRONGTYPE)."""
    try:
        call()
    except redis.exceptions.NoPermissionError:
        return False
    except redis.exceptions.ResponseError:
        return True
    return True


def test_each_fleet_user_touches_exactly_its_own_keys(redis_server):
    """With the ACL the operator sets (redis_auth.setuser_args) on a real Redis, between fleets
    whose names and namespaces extend one another's: each user reads its live state and may not
    write it, reads and writes its own windows, summaries, cluster windows and drift counts (as
    its workers and routers do: a transaction of HSET and EXPIRE), and touches no other key: not
    another fleet's, nor the keys of its own that only the loop writes."""
    admin = redis_server.client()
    users = {}
    for namespace, name in NEIGHBOURS:
        password = redis_auth.fleet_password(ADMIN, namespace, name, "uid-1")
        admin.execute_command(*redis_auth.setuser_args(namespace, name, password))
        users[namespace, name] = login(redis_server, redis_auth.fleet_username(namespace, name), password)
        keys = fleet_keys(namespace, name)
        assert set(keys) == {"state", *redis_auth.OWN_KEYS}  # a new kind of key gets its case here
        admin.set(keys["state"], LiveState(version=1).to_json())
        for kind in redis_auth.OWN_KEYS:
            admin.hset(keys[kind], "chat", "{}")
        for key in loop_keys(namespace, name):
            admin.set(key, "{}")

    leaks = []
    for (namespace, name), user in users.items():
        foreign = [*loop_keys(namespace, name)]
        for other in NEIGHBOURS:
            if other != (namespace, name):
                foreign += [*fleet_keys(*other).values(), *loop_keys(*other)]
        for key in foreign:
            for what, call in (("GET", lambda: user.get(key)), ("HGETALL", lambda: user.hgetall(key)),
                               ("EXISTS", lambda: user.exists(key)), ("HSET", lambda: user.hset(key, "x", "1")),
                               ("EXPIRE", lambda: user.expire(key, 1)), ("DEL", lambda: user.delete(key))):
                if allowed(call):
                    leaks.append(f"{namespace}/{name} may {what} {key}")
        own = fleet_keys(namespace, name)
        assert user.get(own["state"]) == admin.get(own["state"])
        for what, call in (("HSET", lambda: user.hset(own["state"], "x", "1")),
                           ("EXPIRE", lambda: user.expire(own["state"], 1)),
                           ("DEL", lambda: user.delete(own["state"]))):
            if allowed(call):
                leaks.append(f"{namespace}/{name} may {what} its own live state")
    assert not leaks, "\n".join(leaks)

    for (namespace, name), user in users.items():
        for kind in redis_auth.OWN_KEYS:
            key = fleet_keys(namespace, name)[kind]
            with user.pipeline(transaction=True) as pipe:
                assert pipe.hset(key, "code", name).expire(key, 30).execute() == [1, True]
            assert user.hgetall(key) == {b"chat": b"{}", b"code": name.encode()} and user.exists(key) == 1
            assert user.delete(key) == 1
    for namespace, name in NEIGHBOURS:  # nothing of a fleet's was written but by the fleet itself
        assert LiveState.from_json(admin.get(state_key(namespace, name))).version == 1
        assert [admin.get(key) for key in loop_keys(namespace, name)] == [b"{}", b"{}"]


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
        secret = cluster.live("v1", "secrets", "default", redis_secret_name(cluster, "a"))
        handle = cluster.live("v1", "configmaps", "default", redis_secret_name(cluster, "a"))
        assert secret["immutable"] is True and secret["type"] == "Opaque"
        assert [r["uid"] for r in secret["metadata"]["ownerReferences"]] == [handle["metadata"]["uid"]]
        assert [r["uid"] for r in handle["metadata"]["ownerReferences"]] == [sdd["metadata"]["uid"]]
        # created, and never read, edited or deleted
        assert {m for m, p in cluster.log if "/secrets" in p} == {"POST"}
        for deployment in (child_name("a", "stable"), child_name("a", "canary"), router_name("a")):
            env = {e["name"]: e for e in cluster.live("apps/v1", "deployments", "default", deployment)["spec"][
                "template"]["spec"]["containers"][0]["env"]}
            assert env["SPECFLEET_REDIS_URL"]["value"] == redis_server.url
            assert env["SPECFLEET_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
                "name": redis_secret_name(cluster, "a"), "key": "password"}
            assert env["SPECFLEET_REDIS_USERNAME"]["valueFrom"]["secretKeyRef"]["name"] == redis_secret_name(cluster, "a")
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
