"""Liveness reflects the reconciler: /healthz turns 503 when the event loop stalls or a reconcile hangs."""
import asyncio
import threading
import urllib.error
import urllib.request

from specfleet_operator import handlers
from specfleet_operator.health import Heartbeat, serve
from specfleet_operator.testing import OperatorThread, sdd_body, wait_for


def get(port, path):
    """(status, body) of a GET on the local server; 503 is an answer, not an error."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_hung_piece_of_work_or_a_stalled_loop_is_not_live():
    now = [100.0]
    hb = Heartbeat(stale_after_s=30, clock=lambda: now[0])
    assert hb.problem() is None
    with hb.working("reconcile ml/chat"):
        now[0] += 29
        hb.beat()
        assert hb.problem() is None  # long, not yet hung
        now[0] += 2
        hb.beat()
        assert hb.problem() == "reconcile ml/chat has run for 31 s (stale after 30 s)"
    assert hb.problem() is None
    now[0] += 31  # no beat: the loop is blocked
    assert "event loop has not run for 31 s" in hb.problem()


def test_healthz_answers_from_the_heartbeat_and_metrics_stay_served():
    now = [0.0]
    hb = Heartbeat(stale_after_s=10, clock=lambda: now[0])
    server = serve(0, hb, addr="127.0.0.1")
    try:
        port = server.server_port
        assert get(port, "/healthz") == (200, "ok\n")
        now[0] = 11.0
        status, body = get(port, "/healthz")
        assert status == 503 and "has not run for 11 s" in body
        status, body = get(port, "/metrics")
        assert status == 200 and "specfleet_fallback_active" in body
    finally:
        server.shutdown()
        server.server_close()


async def test_a_hanging_reconcile_fails_the_running_operators_liveness(cluster, kube, monkeypatch):
    release = threading.Event()

    async def hang(body, memo, *args, **kwargs):
        while not release.is_set():  # an API call that never answers, say
            await asyncio.sleep(0.05)

    monkeypatch.setattr(handlers, "reconcile", hang)
    op = OperatorThread(cluster.endpoint, "op-a")
    op.options.heartbeat = Heartbeat(stale_after_s=1.0)
    server = serve(0, op.options.heartbeat, addr="127.0.0.1")
    port = server.server_port
    op.start()
    try:
        await wait_for(lambda: op.ready.is_set(), 20, "the operator to start")
        await asyncio.sleep(1.5)  # longer than stale_after_s: only beats keep it live
        assert (await asyncio.to_thread(get, port, "/healthz"))[0] == 200
        await kube.create(sdd_body("chat"))

        async def probe():
            return await asyncio.to_thread(get, port, "/healthz")
        status, body = None, ""
        for _ in range(100):  # at most ~10 s
            status, body = await probe()
            if status == 503:
                break
            await asyncio.sleep(0.1)
        assert status == 503 and "reconcile default/chat has run for" in body, (status, body)
        release.set()
        for _ in range(100):
            status, body = await probe()
            if status == 200:
                break
            await asyncio.sleep(0.1)
        assert status == 200, body
    finally:
        release.set()
        await op.stop_and_join()
        server.shutdown()
        server.server_close()
