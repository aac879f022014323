"""Two operator installs (two chart releases, each its own Lease) watching the same namespace, with
the real kopf operator on the emulator: exactly one reconciles a fleet (the one whose name the fleet's
claim annotation carries), the other leaves it alone and says so once; removing the claim hands
the fleet over."""
import contextlib
import copy
import re

import kopf
import pytest
from specfleet_operator import API_VERSION, handlers
from specfleet_operator.handlers import CLAIM_ANNOTATION, CLAIMED_ELSEWHERE
from specfleet_operator.main import Options
from specfleet_operator.testing import OperatorThread, ready, sdd_body, wait_for

FAST = {"converge_interval": 0.5}  # the periodic converge: what picks a released fleet up


def install(cluster, release):
    """One chart release's operator: its Lease (and so its install name) is the release's."""
    op = OperatorThread(cluster.endpoint, f"{release}-0", memo={**FAST, "applied_generations": {}})
    op.options.lease_name = release
    return op


@contextlib.asynccontextmanager
async def two_installs(cluster, kube):
    """team-a's and team-b's operators, started, with fleet `chat` created and Ready; both stopped after."""
    a, b = install(cluster, "team-a"), install(cluster, "team-b")
    a.start(), b.start()
    try:
        for op in (a, b):
            await wait_for(op.ready.is_set, 20, f"{op.options.identity} to start")
        await kube.create(sdd_body("chat"))
        await wait_for(lambda: ready(cluster, "chat"), 30, "chat Ready")
        yield a, b
    finally:
        for op in (a, b):
            if op.thread.is_alive():
                await op.stop_and_join()


def claimant(cluster, name="chat"):
    sdd = cluster.live(API_VERSION, "specdecodedeployments", "default", name) or {}
    return sdd.get("metadata", {}).get("annotations", {}).get(CLAIM_ANNOTATION)


def events(cluster, reason):
    return [e for e in cluster.all_live("v1", "events") if e.get("reason") == reason]


async def test_two_installs_never_both_reconcile_one_fleet(cluster, kube):
    async with two_installs(cluster, kube) as (a, b):
        owner = claimant(cluster)
        assert owner in ("default/team-a", "default/team-b")
        mine, other = (a, b) if owner == "default/team-a" else (b, a)
        await wait_for(lambda: events(cluster, CLAIMED_ELSEWHERE), 20, "the other install to say it leaves it alone")
        # every reconcile after a spec change is the claimant's alone
        await kube.patch(API_VERSION, "SpecDecodeDeployment", "default", "chat", {"spec": {"replicas": 2}})
        await wait_for(lambda: mine.memo["applied_generations"].get(("default", "chat")) == 2, 20,
                       "the claimant to apply generation 2")
        await wait_for(lambda: ready(cluster, "chat"), 30, "chat Ready at 2 replicas")
        assert ("default", "chat") not in other.memo["applied_generations"]
        (said,) = events(cluster, CLAIMED_ELSEWHERE)  # once, not once per reconcile
        # each install keeps its own record of what it handled: shared, the one that leaves the
        # fleet alone took the claimant's record for its own and never looked at the fleet again
        notes = cluster.live(API_VERSION, "specdecodedeployments", "default", "chat")["metadata"]["annotations"]
        for op in (a, b):
            assert f"{op.options.kopf_prefix}/last-handled-configuration" in notes
        assert owner in said["message"] and CLAIM_ANNOTATION in said["message"]
        # the claimant goes (uninstalled); its claim removed, the other install takes the fleet over
        await mine.stop_and_join()
        await kube.patch(API_VERSION, "SpecDecodeDeployment", "default", "chat",
                         {"metadata": {"annotations": {CLAIM_ANNOTATION: None}}})
        await wait_for(lambda: claimant(cluster) == f"default/{other.options.lease_name}", 20,
                       "the other install to claim the released fleet")
        await kube.patch(API_VERSION, "SpecDecodeDeployment", "default", "chat", {"spec": {"replicas": 1}})
        await wait_for(lambda: other.memo["applied_generations"].get(("default", "chat")) == 3, 20,
                       "the new claimant to apply generation 3")


async def test_a_fleet_claimed_by_another_install_is_deleted_by_that_install(cluster, kube):
    """The finalizer is shared: the install that does not own the fleet waits for the owner's
    cleanup instead of releasing it first."""
    async with two_installs(cluster, kube):
        await kube.delete(API_VERSION, "SpecDecodeDeployment", "default", "chat")
        await wait_for(lambda: cluster.live(API_VERSION, "specdecodedeployments", "default", "chat") is None, 30,
                       "the fleet to go")
        assert not [d for d in cluster.all_live("apps/v1", "deployments") if d["metadata"]["name"].startswith("chat")]


@pytest.mark.parametrize("name,namespace", [("team-a", "default"), ("specfleet", "specfleet-system"),
                                            ("a" * 63, "b" * 63), ("x" * 200, "ns"), ("my.lease", "ns")])
def test_each_install_has_a_valid_annotation_prefix_of_its_own(name, namespace):
    prefix = Options(lease_name=name, lease_namespace=namespace).kopf_prefix
    assert len(prefix) <= 253 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", prefix)
    assert all(len(label) <= 63 for label in prefix.split("."))
    assert prefix.endswith(".serving.specfleet.dev")
    others = {Options(lease_name=name + "x", lease_namespace=namespace).kopf_prefix,
              Options(lease_name=name, lease_namespace=namespace + "x").kopf_prefix}
    assert prefix not in others


async def test_a_claim_from_a_stale_read_loses_to_the_claim_that_landed(cluster, kube, monkeypatch):
    """Two installs read the unclaimed fleet; one claims it first. The other's claim, made from its
    stale read, is refused by the API server (409: the resourceVersion it was conditional on has
    moved) and retried, and the first install keeps the fleet: the race played in order, every time."""
    said = []
    monkeypatch.setattr(handlers, "_event", lambda body, reason, message: said.append(reason))
    await kube.create(sdd_body("chat"))
    read_by_both = await kube.get(API_VERSION, "SpecDecodeDeployment", "default", "chat")
    first, second = (kopf.Memo(kube=kube, instance=f"default/team-{x}") for x in "ab")
    assert await handlers.claim(first, copy.deepcopy(read_by_both))
    with pytest.raises(kopf.TemporaryError, match="changed while being claimed"):
        await handlers.claim(second, copy.deepcopy(read_by_both))
    assert claimant(cluster) == "default/team-a" and said == ["Claimed"]
    # its retry reads the fleet again and leaves it alone
    assert not await handlers.claim(second, await kube.get(API_VERSION, "SpecDecodeDeployment", "default", "chat"))
    assert claimant(cluster) == "default/team-a" and said == ["Claimed", CLAIMED_ELSEWHERE]
