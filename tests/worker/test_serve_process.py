"""`specfleet serve` as the router's tests and `specfleet up` run it: a child process on the tiny
model with ports picked at start (read from its `listening` log line), text and chat messages
served, and the deployment's live state followed from a real redis-server."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest

from specfleet_api.live_state import KBounds, LiveState, state_key
from specfleet_worker.testing import CharTokenizer, WorkerProcess, listening_ports, pb

RPC_S = 30


def test_a_tiny_random_worker_process_serves_text_and_messages_and_follows_the_live_state(tmp_path, redis_server):
    config = tmp_path / "engine.json"
    config.write_text(json.dumps({"model": {"name": "tiny-random", "uri": None}, "draft": {"method": "ngram"},
                                  "speculation": {"kMin": 0, "kMax": 8}, "role": "canary"}))
    env = {"SPECFLEET_REDIS_URL": redis_server.url, "SPECFLEET_DEPLOYMENT": "default/demo", "POD_NAME": "pod-a"}
    with WorkerProcess(config, "--threads", "1", "--max-batch-size", "2", env=env) as w:
        listening = [rec for rec in w.seen if listening_ports(rec)]
        assert len(listening) == 1 and listening[0]["grpc_port"] == w.grpc_port > 0
        assert listening[0]["http_port"] == w.http_port > 0 and w.grpc_port != w.http_port

        text = w.gen.Generate(pb.GenerateRequest(prompt="hello hello", max_tokens=12, ignore_eos=True),
                              timeout=RPC_S)
        assert text.usage.prompt_tokens == len("hello hello") and len(text.text) > 0
        chat = [pb.ChatMessage(role="system", content="Be brief."), pb.ChatMessage(role="user", content="Hi")]
        streamed = list(w.gen.GenerateStream(pb.GenerateRequest(messages=chat, max_tokens=12, ignore_eos=True),
                                             timeout=RPC_S))
        assert streamed[-1].usage.prompt_tokens == len(CharTokenizer().chat_messages(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]))
        assert "".join(c.text for c in streamed) and streamed[-1].finish_reason == "length"

        state = LiveState(version=4, k={"canary": KBounds(2, 3), "stable": KBounds(0, 1)})
        redis_server.client().set(state_key("default", "demo"), state.to_json())
        written, cfg = time.monotonic(), None
        while time.monotonic() - written < 2.0:
            cfg = w.admin.GetConfig(pb.GetConfigRequest(), timeout=RPC_S)
            if (cfg.k_min, cfg.k_max) == (2, 3):
                break
            time.sleep(0.05)
        assert (cfg.k_min, cfg.k_max) == (2, 3), "the canary's bounds were not applied within 2 s"
        metrics = urllib.request.urlopen(f"{w.http}/metrics", timeout=RPC_S).read().decode()
        assert 'spec_decode_live_state_version{model="tiny-random"} 4.0' in metrics
        assert 'spec_decode_live_state_staleness_seconds{model="tiny-random"}' in metrics
        while not redis_server.client().exists("specfleet:v1:default/demo:worker:pod-a"):  # published at start
            assert time.monotonic() - written < 5.0, "the worker did not publish its statistics"
            time.sleep(0.05)
    assert w.proc.returncode == 0
    assert not redis_server.client().exists("specfleet:v1:default/demo:worker:pod-a")  # deleted as it left


@pytest.mark.parametrize("line, ports", [
    ('{"ts": "t", "level": "info", "logger": "specfleet.worker", "msg": "listening", "grpc_port": 40001, '
     '"http_port": 40002}', (40001, 40002)),
    ('{"ts": "t", "level": "info", "logger": "specfleet.worker", "msg": "ready", "model": "tiny-random"}', None),
])
def test_the_listening_line_names_both_ports(line, ports):
    assert listening_ports(json.loads(line)) == ports
