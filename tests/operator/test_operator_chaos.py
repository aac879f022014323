"""The operator SIGKILLed at random points of a reconcile, on the emulator: a real `specfleet
operator` process is killed just before or just after its n-th write (n and which drawn from a
seeded RNG), twice (while creating a fleet with a canary, then while removing the canary), and a
fresh operator converges. After each run: every child exists once, owned by the live resource and
nothing else, nothing of the canary is left, the status is current, and the SLO loop ticks."""
import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import kmock
import kopf
import pytest
from specfleet_operator import API_VERSION, GROUP, KIND, converge
from specfleet_operator import manifests as m
from specfleet_operator.kube import PLURALS, apply_patch
from specfleet_operator.testing import (
    Cluster,
    OperatorThread,
    declare_resources,
    publish_window,
    ready,
    sdd_body,
    stored_live_state,
    wait_for,
    write_kubeconfig,
)

SEEDS = range(10)
WRITES = {"POST", "PUT", "PATCH", "DELETE"}
#: A run of the real operator writes 24 times while creating this fleet (kopf's finalizer and diff
#: base, 14 children, the status as the workers come up) and about 16 while removing its canary (3
#: of them deletes), fewer when the first run had not created it all: a kill point drawn up to
#: these falls inside the reconcile (else the operator is killed once idle, and the run says so).
CREATE_WRITES, REMOVE_WRITES = 22, 6
IDLE_S = 3.0  # no write for this long: the operator is done, kill it there


class KillingCluster(Cluster):
    """The emulator, which SIGKILLs the operator process `victim` at its `kill_at`-th write (Events
    aside: kopf posts them from a queue, in no fixed order): before serving it (the write is lost)
    or after (it lands, the answer is lost)."""

    victim: asyncio.subprocess.Process | None = None
    kill_at, before, writes_seen, killed_at = 0, False, 0, None

    async def _handle(self, request):
        method = str(request.method).upper().rsplit(".", 1)[-1]
        victim = self.victim
        if victim is None or method not in WRITES or "/events" in request.url.path:
            return await super()._handle(request)
        self.writes_seen += 1
        if self.writes_seen != self.kill_at:
            return await super()._handle(request)
        self.victim, self.killed_at = None, f"{'before' if self.before else 'after'} {method} {request.url.path}"
        if self.before:
            os.kill(victim.pid, signal.SIGKILL)
            raise kmock.KubernetesError(status=503, reason="ServiceUnavailable", message="killed")
        response = await super()._handle(request)
        os.kill(victim.pid, signal.SIGKILL)
        return response


@pytest.fixture()
async def cluster():
    """conftest's emulator, as a KillingCluster (conftest's `kube` talks to it)."""
    async with KillingCluster() as handler, kmock.Server(handler):
        declare_resources(handler)
        yield handler


async def run_and_kill(cluster, kubeconfig, log, kill_at: int, before: bool) -> str:
    """A `specfleet operator` process, SIGKILLed at its kill_at-th write; what it was doing then."""
    cluster.writes_seen, cluster.kill_at, cluster.before, cluster.killed_at = 0, kill_at, before, None
    with log.open("wb") as err:  # a file, not a pipe: the operator never blocks on a full pipe
        proc = await asyncio.create_subprocess_exec(
            # --lease-namespace: the install OperatorThread runs (main.Options.instance), which the
            # fleet's claim names: the fresh operator below is this one restarted, not another install
            sys.executable, "-m", "specfleet_operator.main", "--no-leader-election", "--metrics-port=0",
            "--lease-namespace=default",
            "--loop-interval=3600", "--log-level=WARNING", env={**os.environ, "KUBECONFIG": str(kubeconfig)},
            stdout=subprocess.DEVNULL, stderr=err)
    cluster.victim = proc
    try:
        quiet_since, seen = time.monotonic(), 0
        while proc.returncode is None:  # killed at kill_at, or, when its reconcile wrote less, once idle
            if cluster.writes_seen != seen:
                quiet_since, seen = time.monotonic(), cluster.writes_seen
            elif seen and time.monotonic() - quiet_since > IDLE_S:
                cluster.victim, cluster.killed_at = None, f"idle after {seen} writes"
                os.kill(proc.pid, signal.SIGKILL)
            assert time.monotonic() - quiet_since < 30, f"no write in 30 s (kill at write {kill_at})"
            await asyncio.sleep(0.05)
    finally:
        if proc.returncode is None:
            proc.kill()
        cluster.victim = None
        await asyncio.wait_for(proc.wait(), 10)
    assert proc.returncode == -signal.SIGKILL, \
        f"the operator exited {proc.returncode} by itself:\n{log.read_text()[-3000:]}"
    return cluster.killed_at


def fleet_objects(cluster, ns="default"):
    """Every object of a child kind in the namespace, by (kind, name)."""
    out = {}
    for api_version, kind in converge.CHILD_KINDS:
        for obj in cluster.all_live(api_version, PLURALS[kind]):
            if obj["metadata"].get("namespace") == ns:
                assert (kind, obj["metadata"]["name"]) not in out
                out[(kind, obj["metadata"]["name"])] = obj
    return out


def converged(cluster, name):
    """What is still wrong with the fleet, [] when nothing: children, owners, status."""
    sdd = cluster.live(API_VERSION, "specdecodedeployments", "default", name)
    desired = converge.desired_children(sdd, kopf.Memo(settings=m.Settings()))
    if desired is None:
        return ["no status yet"]
    live = fleet_objects(cluster)
    wrong = [f"missing {k}" for k in desired.keys() - live.keys()]
    wrong += [f"left over {k}" for k in live.keys() - desired.keys()]
    owner = m.owner_reference(sdd)
    for key in desired.keys() & live.keys():
        if live[key]["metadata"].get("ownerReferences") != [owner]:
            wrong.append(f"{key} owned by {live[key]['metadata'].get('ownerReferences')}")
        if patch := apply_patch(live[key], desired[key]):
            wrong.append(f"{key} differs: {patch}")
    status = sdd.get("status") or {}
    if status.get("observedGeneration") != sdd["metadata"]["generation"]:
        wrong.append(f"observedGeneration {status.get('observedGeneration')} of {sdd['metadata']['generation']}")
    if not ready(cluster, name):
        wrong.append(f"not Ready: {status.get('conditions')}")
    return wrong


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
async def test_operator_killed_mid_reconcile_converges_after_restart(seed, cluster, kube, redis_server, tmp_path):
    rng = random.Random(f"chaos-{seed}")
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, cluster.endpoint)
    slo = {"window": "1s", "minDraftTokens": 100}
    created = await kube.create(sdd_body("chaos", replicas=2, canary={"weight": 10}, slo=slo,
                                         redis={"url": redis_server.url}))
    first = await run_and_kill(cluster, kubeconfig, tmp_path / "first.log", rng.randint(1, CREATE_WRITES),
                               rng.random() < 0.5)
    await kube.patch(API_VERSION, KIND, "default", "chaos", {"spec": {"canary": None}})
    second = await run_and_kill(cluster, kubeconfig, tmp_path / "second.log", rng.randint(1, REMOVE_WRITES),
                                rng.random() < 0.5)
    where = f"seed {seed}: killed {first}, then {second}"
    print(where)

    op = OperatorThread(cluster.endpoint, "fresh", loop_interval=0.2, memo={"converge_interval": 0.5}).start()
    try:
        try:
            await wait_for(lambda: not converged(cluster, "chaos"), 20, "converged")
        except AssertionError:
            raise AssertionError(f"{where}: {converged(cluster, 'chaos')}") from None
        live = fleet_objects(cluster)
        assert not any("canary" in name for _, name in live), (where, sorted(live))
        sdd = cluster.live(API_VERSION, "specdecodedeployments", "default", "chaos")
        assert sdd["metadata"]["uid"] == created["metadata"]["uid"]
        assert sdd["metadata"]["finalizers"].count(f"{GROUP}/cleanup") == 1, where
        assert sdd["status"]["replicas"] == {"desired": 2, "ready": 2}, where
        assert sdd["status"]["canary"]["phase"] == "Idle" and not sdd["status"]["canary"]["weight"], where
        # the SLO loop ticks again: it learns a baseline from the windows, then follows them
        client = redis_server.client()
        publish_window(client, "default", "chaos", "code", alpha=0.6)
        baseline = lambda: sdd_status(cluster).get("slo", {}).get("keys", {}).get("type:code", {}).get("baseline")
        await wait_for(lambda: baseline() == 0.6, 10, f"{where}: a baseline learned")
        publish_window(client, "default", "chaos", "code", alpha=0.8)
        await wait_for(lambda: (baseline() or 0) > 0.6, 10, f"{where}: the baseline follows")
        state = stored_live_state(client, name="chaos")
        assert state is not None and state.canary_weight == 0, where
    finally:
        await op.stop_and_join()
    assert op.result == 0


def sdd_status(cluster):
    return (cluster.live(API_VERSION, "specdecodedeployments", "default", "chaos") or {}).get("status", {})


def test_seeds_draw_distinct_kill_points():
    """Ten seeds, ten different (create, removal) kill points: the runs do not repeat each other."""
    points = set()
    for seed in SEEDS:
        rng = random.Random(f"chaos-{seed}")
        points.add((rng.randint(1, CREATE_WRITES), rng.random() < 0.5, rng.randint(1, REMOVE_WRITES),
                    rng.random() < 0.5))
    assert len(points) == len(SEEDS)
