"""The process around the service: tracing on or off by environment, a failing engine step,
bad configuration, and the `specfleet serve` entry point."""
from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import Tracer as SdkTracer

from specfleet_worker.main import main as serve_main
from specfleet_worker.testing import pb, running_worker, tiny_engine, wait_idle
from specfleet_worker.tracing import make_tracer


def test_tracing_is_off_at_no_cost_without_an_endpoint_and_otlp_with_one(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert isinstance(make_tracer("w"), trace.NoOpTracer)
    import opentelemetry.exporter.otlp.proto.grpc.trace_exporter as otlp

    made = []

    class Recording(otlp.OTLPSpanExporter):
        def __init__(self, **kw):
            made.append(kw)
            super().__init__(**kw)

    monkeypatch.setattr(otlp, "OTLPSpanExporter", Recording)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert isinstance(make_tracer("w"), SdkTracer)
    assert made == [{"endpoint": "http://127.0.0.1:4317"}]


def test_a_failing_engine_step_fails_the_batch_with_internal_and_the_worker_serves_on():
    engine = tiny_engine()
    real = engine._forward
    calls = {"n": 0}

    def flaky(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(*args, **kw)

    engine._forward = flaky
    with running_worker(engine) as r:
        with pytest.raises(grpc.RpcError) as e:
            r.gen.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=10, ignore_eos=True))
        assert e.value.code() == grpc.StatusCode.INTERNAL and "illegal memory access" in e.value.details()
        ok = r.gen.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=10, ignore_eos=True))
        stats = wait_idle(r)
    assert len(ok.token_ids) == 10
    assert stats.failed_total == 1 and stats.kv_blocks_used == 0


def test_a_bad_config_exits_2_with_a_json_error(tmp_path, capsys):
    bad = tmp_path / "engine.json"
    bad.write_text(json.dumps({"draft": {"method": "telepathy"}}))
    assert serve_main(["--config", str(bad), "--grpc-port", "0", "--http-port", "0"]) == 2
    rec = json.loads(capsys.readouterr().err.splitlines()[-1])
    assert rec["msg"] == "bad configuration" and "draft.method" in rec["error"]
    assert serve_main(["--config", str(tmp_path / "missing.json")]) == 2


def test_specfleet_serve_passes_its_arguments_to_the_worker():
    out = subprocess.run([sys.executable, "-m", "specfleet_cli.main", "serve", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--drain-seconds" in out.stdout


class FakeRedis:
    """The three calls the publisher makes, recorded; `down` makes them fail as a lost server would."""

    def __init__(self):
        self.hashes, self.ttl, self.down = {}, {}, False

    def pipeline(self):
        return self

    def hset(self, key, mapping):
        self.hashes[key] = dict(mapping)

    def expire(self, key, seconds):
        self.ttl[key] = seconds

    def execute(self):
        if self.down:
            raise ConnectionError("redis went away")

    def delete(self, key):
        self.hashes.pop(key, None)


def test_fleet_statistics_are_published_with_an_expiry_and_redis_outages_are_survived():
    from specfleet_worker.fleet import FleetPublisher

    with running_worker() as r:
        r.gen.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3, 1, 2, 3], max_tokens=30, ignore_eos=True))
        fake = FakeRedis()
        pub = FleetPublisher(fake, r.worker, name="pod-a", period_s=5)
        assert pub.publish_once()
        h = fake.hashes["specfleet:worker:pod-a"]
        assert fake.ttl["specfleet:worker:pod-a"] == 15
        assert h["model"] == "tiny-random" and h["requests_total"] == "1"
        assert float(h["mean_accepted_length"]) >= 1.0 and "default" in json.loads(h["acceptance_rate_by_prompt_type"])
        fake.down = True
        assert not pub.publish_once()  # logged, not raised
        pub.stop()
        assert "specfleet:worker:pod-a" not in fake.hashes
