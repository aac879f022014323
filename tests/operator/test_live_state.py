"""The live state in Redis, written by the operator (redis_state.LiveStateStore) from the spec and the
loop's state, against a real redis-server: versions that only grow, no write when nothing changed,
a Redis that is away or paused costs a timeout and no exception, and the document is one the
router's own reader takes."""
import asyncio
import dataclasses
import time

from specfleet_api.live_state import KBounds, LiveState, state_key
from specfleet_local.redis_server import free_port
from specfleet_router.metrics import RouterMetrics
from specfleet_router.state import RedisState

from specfleet_operator import API_VERSION, KIND
from specfleet_operator.redis_state import LiveStateStore
from specfleet_operator.testing import OperatorThread, publish_window, ready, sdd_body, stored_live_state, wait_for

WANTED = LiveState(canary_weight=1.0, routes={"chat": "none"}, k={"stable": KBounds(0, 8)})


def stored(client, ns="default", name="chat"):
    return stored_live_state(client, ns, name)


async def test_versions_grow_and_an_unchanged_state_is_not_written(redis_server):
    client = redis_server.client()
    store = LiveStateStore(clock=lambda: 1000.0)
    try:
        first = await store.write(redis_server.url, "default", "chat", WANTED)
        assert first.version == 1 and stored(client) == first and first.updated == 1000.0
        store.clock = lambda: 2000.0
        again = await store.write(redis_server.url, "default", "chat", dataclasses.replace(WANTED, version=77))
        assert again == first and stored(client).updated == 1000.0  # same content: nothing written
        changed = await store.write(redis_server.url, "default", "chat", dataclasses.replace(WANTED, canary_weight=5.0))
        assert changed.version == 2 and stored(client).canary_weight == 5.0
        # Redis lost everything: the next document still counts up from what this operator wrote
        client.flushall()
        assert (await store.write(redis_server.url, "default", "chat", WANTED)).version == 3
        # another writer went further: one above the stored version
        client.set(state_key("default", "chat"), dataclasses.replace(WANTED, version=40).to_json())
        assert (await store.write(redis_server.url, "default", "chat", dataclasses.replace(WANTED, speculate=False))
                ).version == 41
        # garbage under the key is replaced
        client.set(state_key("default", "chat"), b"{not json")
        assert (await store.write(redis_server.url, "default", "chat", WANTED)).version == 42
        assert stored(client).version == 42
        assert await store.delete(redis_server.url, "default", "chat") and stored(client) is None
    finally:
        await store.close()


async def test_redis_away_or_paused_costs_one_timeout_not_an_exception(redis_server):
    store = LiveStateStore(timeout_s=0.3, retry_after_s=1.0)
    try:
        t0 = time.monotonic()
        assert await store.write(f"redis://127.0.0.1:{free_port()}/0", "default", "chat", WANTED) is None
        assert time.monotonic() - t0 < 2.0
        client = redis_server.client()
        client.execute_command("CLIENT", "PAUSE", "1500", "ALL")
        t0 = time.monotonic()
        assert await store.write(redis_server.url, "default", "chat", WANTED) is None
        assert 0.25 < time.monotonic() - t0 < 1.2  # the timeout, once
        t0 = time.monotonic()
        assert await store.write(redis_server.url, "default", "other", WANTED) is None
        assert time.monotonic() - t0 < 0.1  # within retry_after_s of the failure: not tried at all
        await asyncio.sleep(1.6)  # the pause and the back-off end: the next write goes through
        doc = await store.write(redis_server.url, "default", "chat", WANTED)
        assert doc is not None and stored(client) == doc
    finally:
        await store.close()


async def test_the_operator_keeps_the_live_state_in_redis(cluster, kube, redis_server):
    """Spec -> Redis: the canary's request share, the routes and each arm's K bounds; a spec change
    and the loop's fallback each write a higher version; a flushed Redis is written again at the
    next tick; the router's reader (specfleet_router.state) takes every document."""
    op = OperatorThread(cluster.endpoint, "op-a", loop_interval=0.2).start()
    client = redis_server.client()
    router_view = RedisState(redis_server.url, "default", "live", LiveState(), RouterMetrics())

    async def router_takes(doc):
        assert await router_view.poll_once() and router_view.current == doc
    try:
        await kube.create(sdd_body("live", redis={"url": redis_server.url}, speculation={"kMin": 1, "kMax": 6},
                                   slo={"window": "1s", "minDraftTokens": 100, "fallback": {"minDwell": "1s"}},
                                   routing={"byPromptType": {"chat": "none", "code": "ngram"}},
                                   canary={"weight": 0.5, "replicas": 2, "overrides": {"speculation": {"kMax": 12}}}))
        await wait_for(lambda: ready(cluster, "live"), 20, "Ready")
        # the canary gets its share once its workers are Ready (the analysis' Waiting phase routes nothing)
        first = await wait_for(lambda: (d := stored(client, name="live")) and d.canary_weight == 0.5 and d, 20,
                               "the live state in Redis with the canary's share")
        assert (first.canary_weight, first.routes, first.speculate) == (0.5, {"chat": "none", "code": "ngram"}, True)
        assert first.k == {"stable": KBounds(1, 6), "canary": KBounds(1, 12)} and first.default_method == "ngram"
        await router_takes(first)
        canary = cluster.live("apps/v1", "deployments", "default", "live--canary")
        assert canary["spec"]["replicas"] == 2  # canary.replicas, not a share of the stable pods

        await kube.patch(API_VERSION, KIND, "default", "live", {"spec": {"canary": {"weight": 2.5}}})
        second = await wait_for(lambda: (d := stored(client, name="live")) and d.canary_weight == 2.5 and d,
                                20, "the new weight in Redis")
        assert second.version > first.version
        await router_takes(second)

        publish_window(client, "default", "live", "code", alpha=0.02, speedup=0.9)  # the SLO is missed
        third = await wait_for(lambda: (d := stored(client, name="live")) and d.fallback == ("code",) and d,
                               20, "the fallback in Redis")
        assert third.version > second.version and third.k["stable"] == KBounds(1, 6) and third.speculate
        assert third.method_for("code") == "none" and third.method_for("chat") == "none"  # chat: its route
        assert third.route("code", draw=0.5) == ("ngram", True) and third.probe_share == 5.0
        await router_takes(third)

        client.flushall()
        fourth = await wait_for(lambda: stored(client, name="live"), 10, "written again after a flush")
        assert fourth.version > third.version and fourth.fallback == ("code",)

        await kube.delete(API_VERSION, KIND, "default", "live")
        await wait_for(lambda: stored(client, name="live") is None, 20, "the document deleted with the fleet")
    finally:
        await op.stop_and_join()
        await router_view.close()


async def test_no_redis_no_document_and_the_router_gets_the_state_in_flags(cluster, kube, redis_server):
    op = OperatorThread(cluster.endpoint, "op-a", loop_interval=0.2).start()
    try:
        await kube.create(sdd_body("flags", canary={"weight": 0.25}))
        await wait_for(lambda: ready(cluster, "flags"), 20, "Ready")
        def weight():
            args = cluster.live("apps/v1", "deployments", "default", "flags--router")["spec"]["template"]["spec"][
                "containers"][0]["args"]
            return args[args.index("--canary-weight") + 1]
        # 0 while the canary waits for its workers, its share once they are Ready
        await wait_for(lambda: weight() == "0.25", 20, "the canary's share in the router's flags")
        assert redis_server.client().keys("*") == []
    finally:
        await op.stop_and_join()


async def test_a_fleet_deleted_while_its_spec_is_invalid_leaves_no_live_state(cluster, kube, redis_server):
    """Valid first (its live state written), then edited into an invalid spec, then deleted: the
    document goes with it, as it would from a valid one."""
    op = OperatorThread(cluster.endpoint, "op-a", loop_interval=0.2).start()
    client = redis_server.client()
    try:
        await kube.create(sdd_body("broken", redis={"url": redis_server.url}))
        await wait_for(lambda: stored(client, name="broken"), 20, "the live state in Redis")
        await kube.patch(API_VERSION, KIND, "default", "broken", {"spec": {"speculation": {"kMin": 9, "kMax": 4}}})

        def invalid():
            sdd = cluster.live(API_VERSION, "specdecodedeployments", "default", "broken") or {}
            return any(c["type"] == "Ready" and c.get("reason") == "InvalidSpec"
                       for c in (sdd.get("status") or {}).get("conditions", []))
        await wait_for(invalid, 20, "the edit refused (InvalidSpec)")
        await kube.delete(API_VERSION, KIND, "default", "broken")
        await wait_for(lambda: stored(client, name="broken") is None, 20, "the document deleted with the fleet")
    finally:
        await op.stop_and_join()
