"""The fleets' Redis credentials with the real operator on the emulator and a real Redis: the
operator only ever creates Secrets (never reads, edits or deletes one), leaves a Secret or handle
someone else holds alone (said once), and a rotated admin password gives every fleet new credentials
that its pods roll to, the old ones accepted until they have; a pod Redis refuses shows in the
status (Degraded) and in the operator's metric."""
import asyncio
import base64

import redis

from specfleet_api import redis_auth

from specfleet_operator import API_VERSION, metrics
from specfleet_operator import manifests as m
from specfleet_operator.redis_state import FOREIGN_SECRET, DefaultRedis, LiveStateStore, credentials_name
from specfleet_operator.testing import OperatorThread, ready, sdd_body, wait_for

ADMIN, ROTATED = "admin-secret", "rotated-secret"
SDDS = "specdecodedeployments"
FOREIGN = {"apiVersion": "helm.example/v1", "kind": "Release", "name": "web", "uid": "uid-of-web", "controller": True}
UID = "11111111-2222-3333-4444-555555555555"  # given at create, so a test can name the fleet's Secret first


def condition(cluster, name, ctype="Ready"):
    sdd = cluster.live(API_VERSION, SDDS, "default", name) or {}
    return next((c for c in (sdd.get("status") or {}).get("conditions", []) if c["type"] == ctype), None)


def events(cluster, reason):
    return [e for e in cluster.all_live("v1", "events") if e.get("reason") == reason]


def user_of(name, master, uid=UID):
    return redis_auth.fleet_username("default", name), redis_auth.fleet_password(master, "default", name, uid)


def secret_name(name, master, uid=UID):
    return credentials_name(name, *user_of(name, master, uid))


def secret_writes(cluster):
    """Every request on a Secret but the creates: a read, an edit or a delete."""
    return [(v, p) for v, p in cluster.log if "/secrets" in p and v != "POST"]


def env_secrets(cluster, deployment):
    spec = cluster.live("apps/v1", "deployments", "default", deployment)["spec"]["template"]["spec"]
    return {(e.get("valueFrom") or {}).get("secretKeyRef", {}).get("name")
            for c in spec["containers"] for e in c.get("env") or [] if e.get("valueFrom", {}).get("secretKeyRef")}


def operator(cluster, redis_server, password_file=None, store=None):
    memo = {"default_redis": DefaultRedis(redis_server.url, ADMIN, password_file), "converge_interval": 0.3}
    if store is not None:
        memo["live_state"] = store
    return OperatorThread(cluster.endpoint, "op-a", loop_interval=0.3, memo=memo).start()


async def create_fleet_held(cluster, kube, name="demo"):
    """Create the fleet (its uid given, so the test knew its Secret's name) and wait for Ready
    False, ChildOwnedByAnother; that condition."""
    body = sdd_body(name)
    body["metadata"]["uid"] = UID
    await kube.create(body)
    return await wait_for(lambda: (c := condition(cluster, name)) and c["reason"] == "ChildOwnedByAnother" and c,
                          20, "Ready False, ChildOwnedByAnother")


async def test_a_handle_held_by_another_owner_is_left_alone_and_said_once(cluster, kube, redis_server):
    """The ConfigMap that would hold the fleet's credentials Secret belongs to another controller:
    it is not patched, no Secret is created, Ready and Degraded say whose it is, one Event."""
    redis_server.client().config_set("requirepass", ADMIN)
    name = secret_name("demo", ADMIN)
    theirs = {"apiVersion": "v1", "kind": "ConfigMap", "data": {"theirs": "yes"},
              "metadata": {"name": name, "namespace": "default", "ownerReferences": [FOREIGN]}}
    await kube.create(theirs)
    before = cluster.live("v1", "configmaps", "default", name)
    op = operator(cluster, redis_server)
    try:
        cond = await create_fleet_held(cluster, kube)
        assert f"ConfigMap {name}" in cond["message"] and "Release web" in cond["message"], cond["message"]
        assert condition(cluster, "demo", "Degraded")["reason"] == "ChildOwnedByAnother"
        await wait_for(lambda: events(cluster, "ChildOwnedByAnother"), 10, "the event")
        await asyncio.sleep(1.5)  # converges every 0.3 s and status writes: none writes it, none says it again
        assert cluster.live("v1", "configmaps", "default", name) == before
        assert cluster.live("v1", "secrets", "default", name) is None
        assert [p for v, p in cluster.log if "/secrets" in p] == []
        assert len(events(cluster, "ChildOwnedByAnother")) == 1
    finally:
        await op.stop_and_join()


async def test_a_secret_made_by_someone_else_is_left_alone_until_it_is_gone(cluster, kube, redis_server):
    """A Secret under the fleet's credentials name that the operator did not create (its handle
    did not exist): never read nor overwritten, said once; once deleted, the fleet gets its own.
    A Secret under the name of before (`<fleet>--redis`) is never touched at all."""
    redis_server.client().config_set("requirepass", ADMIN)
    name = secret_name("demo", ADMIN)
    planted = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
               "metadata": {"name": name, "namespace": "default", "ownerReferences": [FOREIGN]},
               "data": {"username": base64.b64encode(b"evil").decode(), "password": base64.b64encode(b"x").decode()}}
    old_name = {**planted, "metadata": {**planted["metadata"], "name": m.child_name("demo", "redis")}}
    await kube.create(planted)
    await kube.create(old_name)
    before = [cluster.live("v1", "secrets", "default", n) for n in (name, old_name["metadata"]["name"])]
    op = operator(cluster, redis_server)
    try:
        cond = await create_fleet_held(cluster, kube)
        assert f"Secret {name}" in cond["message"], cond["message"]
        handle = cluster.live("v1", "configmaps", "default", name)
        assert handle["metadata"]["annotations"][FOREIGN_SECRET] == "true"
        await asyncio.sleep(1.5)  # reconciles keep finding it: still said once, still untouched
        assert [cluster.live("v1", "secrets", "default", n) for n in (name, old_name["metadata"]["name"])] == before
        assert len(events(cluster, "ChildOwnedByAnother")) == 1
        assert secret_writes(cluster) == []

        cluster.log.clear()
        await kube.delete("v1", "Secret", "default", name)
        await wait_for(lambda: ready(cluster, "demo"), 20, "Ready once the name is free")
        ours = cluster.live("v1", "secrets", "default", name)
        assert base64.b64decode(ours["data"]["password"]).decode() == user_of("demo", ADMIN)[1]
        assert FOREIGN_SECRET not in (cluster.live("v1", "configmaps", "default", name)["metadata"]
                                      .get("annotations") or {})
        assert cluster.live("v1", "secrets", "default", old_name["metadata"]["name"]) == before[1]
        assert [(v, p) for v, p in secret_writes(cluster) if v != "DELETE" or not p.endswith(name)] == []
    finally:
        await op.stop_and_join()


def can_login(server, user, password):
    try:
        return server.client(username=user, password=password).ping() is not None or True
    except redis.exceptions.AuthenticationError:
        return False
    except redis.exceptions.NoPermissionError:  # logged in; PING is not among the fleet's commands
        return True


def mark_rolled_out(cluster, deployment):
    """What the Deployment controller reports once every pod runs the latest template."""
    obj = cluster._objects[next(k for k in cluster._objects if k[0].plural == "deployments" and k[2] == deployment)]
    n = obj.raw["spec"].get("replicas", 1)
    obj.patch({"status": {"observedGeneration": obj.raw["metadata"]["generation"], "replicas": n,
                          "readyReplicas": n, "updatedReplicas": n, "availableReplicas": n}})


async def test_a_rotated_admin_password_rolls_the_pods_and_a_refused_pod_shows(cluster, kube, redis_server, tmp_path):
    """The install's Redis password is rotated (its mounted Secret rewritten, Redis following it):
    the fleet gets a new credentials Secret, its Deployments move to it (a roll), Redis accepts the
    old password and the new until every pod holds the new one, then only the new; the old
    Secret's handle goes. A pod still logging in with the old password makes Degraded say so
    (PodsRedisAuthFailed) and the metric count it, and both clear once it stops."""
    redis_server.client().config_set("requirepass", ADMIN)
    password_file = tmp_path / "password"
    password_file.write_text(ADMIN + "\n")
    store = LiveStateStore(retry_after_s=0.3, auth_window_s=2.0)
    op = operator(cluster, redis_server, str(password_file), store)
    workers, router = m.child_name("r", "stable"), m.router_name("r")
    try:
        body = sdd_body("r")
        body["metadata"]["uid"] = UID
        await kube.create(body)
        await wait_for(lambda: ready(cluster, "r") and condition(cluster, "r", "RedisReady")["status"] == "True",
                       30, "Ready, RedisReady")
        old, old_user = secret_name("r", ADMIN), user_of("r", ADMIN)
        assert env_secrets(cluster, workers) == env_secrets(cluster, router) == {old}
        assert can_login(redis_server, *old_user)

        cluster.ready_delay = 3600.0  # the new pods come up when the test says so
        redis_server.client(password=ADMIN).config_set("requirepass", ROTATED)  # as the chart's Redis follows it
        password_file.write_text(ROTATED + "\n")
        new, new_user = secret_name("r", ROTATED), user_of("r", ROTATED)
        await wait_for(lambda: env_secrets(cluster, workers) == env_secrets(cluster, router) == {new}, 20,
                       "the pods moved to the new Secret")
        secret = cluster.live("v1", "secrets", "default", new)
        assert secret["immutable"] is True
        assert base64.b64decode(secret["data"]["password"]).decode() == new_user[1]
        await wait_for(lambda: can_login(redis_server, *new_user), 10, "the new password accepted")
        await asyncio.sleep(1.0)  # ticks while the roll is under way: the old pods still log in
        assert can_login(redis_server, *old_user)
        assert cluster.live("v1", "configmaps", "default", old) is not None

        for deployment in (workers, router):
            mark_rolled_out(cluster, deployment)
        await wait_for(lambda: cluster.live("v1", "configmaps", "default", old) is None, 20, "the old handle retired")
        assert not can_login(redis_server, *old_user) and can_login(redis_server, *new_user)
        assert events(cluster, "Removed")

        async def refused_pod():  # a pod the roll missed keeps trying the old password
            while True:
                can_login(redis_server, *old_user)
                await asyncio.sleep(0.2)

        pod = asyncio.create_task(refused_pod())
        try:
            cond = await wait_for(lambda: (c := condition(cluster, "r", "Degraded")) and c["status"] == "True"
                                  and c["reason"] == "PodsRedisAuthFailed" and c, 20, "Degraded: refused logins")
            assert old_user[0] in cond["message"] and old_user[1] not in cond["message"]
            assert metrics.REDIS_AUTH_FAILURES.labels("default", "r")._value.get() > 0
        finally:
            pod.cancel()
        await wait_for(lambda: condition(cluster, "r", "Degraded")["status"] == "False", 20, "Degraded back to False")
        assert metrics.REDIS_AUTH_FAILURES.labels("default", "r")._value.get() == 0
        assert secret_writes(cluster) == []  # Secrets created, never read, edited or deleted
    finally:
        await op.stop_and_join()


def test_old_credentials_are_retired_only_once_every_pod_holds_the_new():
    """handlers._pods_use: a Deployment whose template still names the old Secret, or that still
    runs pods of an older template, keeps the old credentials alive."""
    from specfleet_operator.handlers import _pods_use

    def deployment(secret, replicas=2, updated=2):
        env = [{"name": "SPECFLEET_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {"name": secret, "key": "password"}}}]
        return {"spec": {"template": {"spec": {"containers": [{"name": "w", "env": env}]}}},
                "status": {"replicas": replicas, "updatedReplicas": updated}}

    assert _pods_use(deployment("new"), "new")
    assert not _pods_use(deployment("old"), "new")
    assert not _pods_use(deployment("new", replicas=3, updated=2), "new")  # an old pod still runs
