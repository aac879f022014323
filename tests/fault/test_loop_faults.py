"""The control loop through Redis faults (SIGKILLed, paused, read-only) under a load of 200
requests: the router loses no request, the loop takes no decision on data it could not read (no
new state, no event, its memory unchanged), and it decides again once Redis is back."""
from __future__ import annotations

import time

import pytest

from specfleet_local.state import ControlLoop, StateWriter, initial_state
from specfleet_operator.spec import with_defaults
from specfleet_router.faults import run_load
from specfleet_worker.fleet import FleetPublisher
from specfleet_worker.live import redis_client

NS, NAME = "team-a", "loop"
SPEC = with_defaults({"model": {"name": "tiny-random", "uri": "tiny-random"}, "replicas": 1,
                      "slo": {"window": "1s", "minDraftTokens": 20,
                              "fallback": {"minDwell": "1s", "recoverAfter": "2s"}}})
PAUSE_S = 8.0  # outlasts the load and the checks after it


def wait(predicate, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < end, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)
    return value


@pytest.mark.parametrize("fault", ["kill", "pause", "read_only"])
def test_the_loop_takes_no_decision_while_redis_is_away_and_resumes_after(fault, h, redis_server):
    client = redis_server.client()
    loop = ControlLoop(SPEC)
    writer = StateWriter(client, NS, NAME, initial_state(SPEC), loop=loop, period_s=0.1)
    writer.write()
    with h.text_worker() as stable:
        publisher = FleetPublisher(redis_client(redis_server.url), stable.worker, name="stable-0",
                                   deployment=(NS, NAME), period_s=0.2, window_s=1.0).start()
        writer.start()
        try:
            with h.router_over([stable], [], redis_url=redis_server.url, namespace=NS, name=NAME,
                               redis_poll_s=0.1) as r:
                warm = run_load(r.base_url, model=NAME, requests=40, clients=8, max_tokens=16)
                assert not warm.failed(), warm.summary()
                wait(lambda: loop.memory.keys, 10, "the loop to judge the first windows")

                def inject():
                    if fault == "kill":
                        redis_server.kill()
                    elif fault == "pause":
                        redis_server.pause(PAUSE_S)
                    else:
                        redis_server.read_only(True)

                report = run_load(r.base_url, model=NAME, requests=200, clients=16, max_tokens=8, fault=inject,
                                  timeout_s=30)
                print(report.summary())
                assert not report.failed(), report.summary()
                if fault != "read_only":  # nothing can be read: nothing is decided
                    time.sleep(0.5)  # a tick that read before the fault has ended
                    decided, events, version, memory = loop.decided, list(loop.events), writer.state.version, loop.memory
                    time.sleep(1.5)
                    assert loop.decided == decided, "the loop decided on data it could not read"
                    assert loop.memory == memory and list(loop.events) == events
                    assert writer.state.version == version
                else:  # reads work, writes fail: the state in force stays the last one written
                    time.sleep(1.0)
                    assert client.get(writer.key) is not None

                if fault == "kill":
                    redis_server.start()
                elif fault == "pause":
                    time.sleep(max(0.0, report.fault_at + PAUSE_S - time.monotonic()))
                else:
                    redis_server.read_only(False)
                after = run_load(r.base_url, model=NAME, requests=40, clients=8, max_tokens=16)
                assert not after.failed(), after.summary()
                resumed = loop.decided
                wait(lambda: loop.decided > resumed + 3, 10, "the loop to decide again")
                wait(lambda: client.get(writer.key) is not None, 10, "the state key written back")
        finally:
            writer.stop()
            publisher.stop()


def test_a_worker_sigkilled_mid_load_with_the_loop_running(h, tmp_path, redis_server):
    """Two `specfleet serve` workers publishing their windows, the loop judging them, one SIGKILLed
    under 200 requests: no request that had not streamed is lost, the dead pod's window expires
    (nothing is decided on it: the loop's memory holds no key of it), and the loop keeps deciding
    on the survivor's windows."""
    from specfleet_worker.testing import WorkerProcess
    from concurrent.futures import ThreadPoolExecutor

    client = redis_server.client()
    loop = ControlLoop(SPEC)
    writer = StateWriter(client, NS, NAME, initial_state(SPEC), loop=loop, period_s=0.1)
    writer.write()
    config = h.worker_config(tmp_path / "stable.json")
    env = {"SPECFLEET_REDIS_URL": redis_server.url, "SPECFLEET_DEPLOYMENT": f"{NS}/{NAME}",
           "SPECFLEET_FLEET_WINDOW_S": "1"}
    workers = [WorkerProcess(config, "--threads", "1", env={**env, "POD_NAME": f"stable-{i}"}) for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda w: w.start(60), workers))
    writer.start()
    try:
        with h.router_over([f"127.0.0.1:{w.grpc_port}" for w in workers], eject_s=30, redis_url=redis_server.url,
                           namespace=NS, name=NAME, redis_poll_s=0.1) as r:
            warm = run_load(r.base_url, model=NAME, requests=40, clients=8, max_tokens=16)
            assert not warm.failed(), warm.summary()
            wait(lambda: loop.memory.keys, 10, "the loop to judge the first windows")
            report = run_load(r.base_url, model=NAME, requests=200, clients=16, max_tokens=16,
                              fault=workers[0].kill, timeout_s=15)
            print(report.summary())
            assert len(report.in_flight_at_fault()) > 0, report.summary()
            assert not report.lost(), [(o.index, o.error, o.message) for o in report.lost()]
            assert not report.hung(), report.summary()
            pods = lambda: {k.decode().rsplit(":", 1)[-1] for k in client.scan_iter(match=f"*{NS}/{NAME}:window:*")}
            wait(lambda: pods() == {"stable-1"}, 10, "the dead worker's window to expire")
            decided = loop.decided
            after = run_load(r.base_url, model=NAME, requests=40, clients=8, max_tokens=16)
            assert not after.failed(), after.summary()
            wait(lambda: loop.decided > decided + 2, 10, "the loop to decide on the survivor's windows")
            assert set(loop.memory.keys) <= {"deployment"} | {f"type:{t}" for t in ("chat", "other", "code", "math",
                                                                                       "translation", "summarization",
                                                                                       "extraction", "rag")}
    finally:
        writer.stop()
        for w in workers:
            w.kill()
