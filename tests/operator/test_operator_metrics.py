"""The operator's own metrics of its reconciles: seconds, errors by kind, and the queue of
reconciles waiting on a fleet's lock (the emulated fleets' end-to-end figures are elsewhere)."""
import asyncio

import kopf
import pytest
from prometheus_client import REGISTRY

from specfleet_operator import handlers
from specfleet_operator.testing import OperatorThread, ready, sdd_body, wait_for


def sample(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_reconcile_is_timed_and_one_that_raises_is_counted():
    body = sdd_body("timed")
    body["metadata"]["uid"] = "u-1"
    before = (sample("specfleet_operator_reconcile_seconds_count"),
              sample("specfleet_operator_reconcile_errors_total", kind="exception"))
    with pytest.raises(Exception):  # a memo without the operator's settings or kopf's context: it raises
        await handlers.reconcile(body, kopf.Memo())
    assert sample("specfleet_operator_reconcile_seconds_count") == before[0] + 1
    assert sample("specfleet_operator_reconcile_errors_total", kind="exception") == before[1] + 1
    assert sample("specfleet_operator_reconciles_waiting") == 0


async def test_reconciles_waiting_on_a_fleets_lock_are_the_queue():
    memo = kopf.Memo()
    lock = handlers.reconcile_lock(memo, "default", "queued")
    await lock.acquire()  # a reconcile of the fleet runs
    waiting = [asyncio.create_task(handlers.reconcile(sdd_body("queued"), memo)) for _ in range(3)]
    await wait_for(lambda: sample("specfleet_operator_reconciles_waiting") == 3, 5, "three reconciles queued")
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    lock.release()
    assert sample("specfleet_operator_reconciles_waiting") == 0


async def test_the_operator_times_its_reconciles(cluster, kube):
    before = sample("specfleet_operator_reconcile_seconds_count")
    op = OperatorThread(cluster.endpoint, "op-m").start()
    try:
        await kube.create(sdd_body("one"))
        await wait_for(lambda: ready(cluster, "one"), 20, "Ready")
        # Ready is written inside the reconcile: its seconds are observed as it returns
        await wait_for(lambda: sample("specfleet_operator_reconcile_seconds_count") > before, 10, "a timed reconcile")
        assert sample("specfleet_operator_reconcile_errors_total", kind="apply") == 0
    finally:
        await op.stop_and_join()
