"""`promtool check metrics` on a live scrape of each component's /metrics: the worker's, the
router's (both in this process, after traffic so that labelled series exist) and the operator's
(`specfleet operator` as a child process, scraped on its metrics port). promtool is Debian's
`prometheus` package, which `./dev setup` installs: a missing promtool fails, never skips."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request


from specfleet_router.testing import running_router
from specfleet_worker.testing import pb, running_worker

TIMEOUT_S = 30  # the most any wait in these tests takes before it fails


def promtool_check(text: str) -> str:
    """promtool's complaints about an exposition (empty when it has none)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: run ./dev setup (installs Debian's prometheus package)"
    p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    return (p.stdout + p.stderr).strip() if p.returncode else ""


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
        return r.read().decode()


def test_promtool_flags_a_gauge_named_like_a_counter():
    # the guard: promtool runs and complains, so a clean result below means something
    bad = "# HELP x_total a gauge\n# TYPE x_total gauge\nx_total 1\n"
    assert "x_total" in promtool_check(bad)


def test_worker_metrics_pass_promtool():
    with running_worker() as w:
        w.gen.Generate(pb.GenerateRequest(prompt_token_ids=[3, 1, 4, 1, 5], max_tokens=8, ignore_eos=True),
                       timeout=TIMEOUT_S)
        text = scrape(w.http + "/metrics")
    assert "spec_decode_kv_blocks_capacity" in text and "spec_decode_num_drafts_total" in text
    assert promtool_check(text) == ""


def test_router_metrics_pass_promtool():
    with running_worker() as w, running_router(backends={"stable": [f"127.0.0.1:{w.server.grpc_port}"]}) as r:
        r.wait_ready(stable=1, timeout_s=TIMEOUT_S)
        status, text = r.get("/metrics")
    assert status == 200 and text.count("# TYPE ") > 3
    assert promtool_check(text) == ""


def test_operator_metrics_pass_promtool():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # `specfleet operator`'s own run(): its metrics port as in a pod, with the kopf part (which needs
    # a cluster) replaced by waiting for SIGTERM, and one fleet in fallback so that series exist.
    code = ("import asyncio, sys; import specfleet_operator.main as m; from specfleet_operator import metrics\n"
            "async def idle(options, stop, **_): await stop.wait(); return 0\n"
            "m.operate = idle; metrics.FALLBACK_ACTIVE.labels('team-a', 'chat').set(1)\n"
            "sys.exit(m.run(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", code, "--no-leader-election", "--metrics-port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end, text = time.monotonic() + TIMEOUT_S, None
        while text is None:
            try:
                text = scrape(f"http://127.0.0.1:{port}/metrics")
            except OSError:
                assert proc.poll() is None, "the operator exited before its metrics port answered"
                assert time.monotonic() < end, f"no /metrics on port {port} within {TIMEOUT_S} s"
                time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(TIMEOUT_S)
    assert 'specfleet_fallback_active{sdd_name="chat",sdd_namespace="team-a"}' in text  # no namespace clash
    assert promtool_check(text) == ""
