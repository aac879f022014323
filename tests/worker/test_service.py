"""The API end to end over loopback gRPC: unary and streaming agree, text streams safely,
statistics travel with each response, the admin surface changes settings live, health and
reflection answer, and the HTTP port serves /metrics, /healthz and /readyz."""
from __future__ import annotations

import io
import json
import logging
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from specfleet_engine.sampling import SamplingParams
from specfleet_worker import logs
from specfleet_worker.testing import CharTokenizer, pb, pb_grpc, running_worker, tiny_engine, wait_idle

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]
TIMEOUT_S = 30  # the most any wait in these tests takes before it fails


def reference(prompt, **params) -> list[int]:
    return tiny_engine().generate(prompt, SamplingParams(**params), method="none").output


def test_unary_and_stream_return_the_same_tokens_with_their_statistics(worker):
    req = pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=30, ignore_eos=True, logprobs=True,
                             request_id="r-1")
    resp = worker.gen.Generate(req)
    chunks = list(worker.gen.GenerateStream(req))
    assert list(resp.token_ids) == reference(PROMPT, max_tokens=30, ignore_eos=True)
    assert [t for c in chunks for t in c.token_ids] == list(resp.token_ids)
    assert [lp for c in chunks for lp in c.logprobs] == pytest.approx(list(resp.logprobs), abs=1e-4)  # drafts differ: so do shapes
    assert len(resp.logprobs) == 30 and all(lp <= 0 for lp in resp.logprobs)
    assert [c.finish_reason for c in chunks][:-1] == [""] * (len(chunks) - 1)
    last = chunks[-1]
    assert (resp.finish_reason, last.finish_reason) == ("length", "length")
    assert resp.request_id == last.request_id == "r-1"
    assert resp.usage.prompt_tokens == len(PROMPT) and resp.usage.completion_tokens == 30
    s = resp.speculation
    # the prefill gives the first token; each step then emits its accepted tokens and one more
    assert s.method == "ngram" and s.num_steps <= 29 <= s.num_steps + s.num_accepted_tokens
    assert s.num_accepted_tokens <= s.num_draft_tokens and sum(s.accepted_per_position) == s.num_accepted_tokens
    assert s.mean_accepted_length == pytest.approx((s.num_accepted_tokens + s.num_steps) / s.num_steps)
    assert resp.latency_s >= resp.time_to_first_token_s > 0


def test_sampling_with_a_seed_is_reproducible_and_plain_decoding_reports_no_drafts(worker):
    req = pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=25, temperature=0.9, top_p=0.9, top_k=20,
                             seed=7, ignore_eos=True, speculation_method="none")
    a, b = worker.gen.Generate(req), worker.gen.Generate(req)
    assert list(a.token_ids) == list(b.token_ids)
    assert a.speculation.method == "none" and a.speculation.num_draft_tokens == 0
    assert a.speculation.mean_accepted_length == 1.0


def test_text_streams_without_leaking_a_stop_string():
    engine = tiny_engine(tokenizer=CharTokenizer())
    with running_worker(engine) as r:
        full = r.gen.Generate(pb.GenerateRequest(prompt="hello hello", max_tokens=60, ignore_eos=True))
        text = full.text
        assert text == CharTokenizer().decode(list(full.token_ids)) and len(text) > 10
        stop = text[8:11]
        chunks = list(r.gen.GenerateStream(pb.GenerateRequest(prompt="hello hello", max_tokens=60,
                                                              ignore_eos=True, stop=[stop])))
        streamed = "".join(c.text for c in chunks)
        assert streamed == text[:text.index(stop)]
        assert chunks[-1].finish_reason == "stop"
        chat = r.gen.Generate(pb.GenerateRequest(prompt="hi", apply_chat_template=True, max_tokens=1))
        assert chat.usage.prompt_tokens == len(CharTokenizer().chat("hi"))


def test_speculation_off_and_k_bounds_apply_live_without_dropping_requests(worker):
    cfg = worker.admin.GetConfig(pb.GetConfigRequest())
    assert cfg.speculation_enabled and (cfg.k_min, cfg.k_max) == (0, 8) and "ngram" in cfg.methods
    results = {}

    def long_request():
        results["long"] = worker.gen.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=300,
                                                                 ignore_eos=True), timeout=TIMEOUT_S)

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    deadline = time.monotonic() + TIMEOUT_S
    while worker.stats().running == 0:
        assert time.monotonic() < deadline, f"the long request was not running after {TIMEOUT_S}s"
        time.sleep(0.005)
    new = worker.admin.UpdateConfig(pb.UpdateConfigRequest(speculation_enabled=False, k_max=2))
    assert not new.speculation_enabled and new.k_max == 2
    plain = worker.gen.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=10))
    t.join(TIMEOUT_S)
    assert not t.is_alive(), f"the long request did not finish within {TIMEOUT_S}s"
    assert plain.speculation.method == "none" and plain.speculation.num_draft_tokens == 0
    assert "long" in results, "the long request failed (its thread raised)"
    assert results["long"].finish_reason == "length"
    assert list(results["long"].token_ids) == reference(PROMPT, max_tokens=300, ignore_eos=True)
    worker.admin.UpdateConfig(pb.UpdateConfigRequest(speculation_enabled=True, k_min=1, k_max=1,
                                                     method_by_prompt_type={"code": "none"}))
    on = worker.gen.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT * 3, max_tokens=40, ignore_eos=True))
    assert on.speculation.method == "ngram" and on.speculation.final_k == 1
    assert max(len(on.speculation.accepted_per_position), 1) == 1  # never more than one draft token
    code = worker.gen.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=5, prompt_type="code"))
    assert code.speculation.method == "none"


def test_bad_admin_updates_are_refused_and_change_nothing(worker):
    before = worker.admin.GetConfig(pb.GetConfigRequest())
    for bad, field in [(pb.UpdateConfigRequest(k_min=5, k_max=2), "k_min"),
                       (pb.UpdateConfigRequest(k_max=99), "k_max"),
                       (pb.UpdateConfigRequest(default_method="draft-model"), "default_method"),  # a method it lacks
                       (pb.UpdateConfigRequest(method_by_prompt_type={"chat": "eagle"}), "method_by_prompt_type")]:
        with pytest.raises(grpc.RpcError) as e:
            worker.admin.UpdateConfig(bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    assert worker.admin.GetConfig(pb.GetConfigRequest()) == before


def test_health_reflection_and_http_probes_follow_the_life_cycle():
    with running_worker() as r:
        health = health_pb2_grpc.HealthStub(r.channel)
        for service in ("", "specfleet.v1.Generation"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(r.channel)
        answer = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in answer.list_services_response.service}
        assert {"specfleet.v1.Generation", "grpc.health.v1.Health"} <= names and "specfleet.v1.Admin" not in names
        assert urllib.request.urlopen(r.http + "/healthz").status == 200
        assert urllib.request.urlopen(r.http + "/readyz").status == 200
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(r.http + "/nope")
        assert e.value.code == 404

        r.server.drain(1.0)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(r.http + "/readyz")
        assert e.value.code == 503 and b"draining" in e.value.read()
        assert urllib.request.urlopen(r.http + "/healthz").status == 200  # alive, only not ready
        with pytest.raises(grpc.RpcError) as e:
            r.gen.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_health_is_not_serving_while_the_model_loads():
    from specfleet_worker.app import WorkerServer

    server = WorkerServer("127.0.0.1", 0, 0, admin_port=0).start()  # no fixed port: another may hold it
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/readyz")
        assert e.value.code == 503 and b"loading" in e.value.read()
        with pytest.raises(grpc.RpcError) as e:
            from specfleet_proto import worker_pb2_grpc

            worker_pb2_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(prompt_token_ids=[1]))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()
    finally:
        server.stop(0)


def scrape(r) -> dict[str, list]:
    text = urllib.request.urlopen(r.http + "/metrics").read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_metrics_carry_the_runbook_names_and_count_what_happened(worker):
    n = 4
    steps = 0
    for i in range(n):  # long enough for the tiny model to repeat itself: some drafts get accepted
        steps += worker.gen.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT[i:], max_tokens=200, ignore_eos=True,
                                               prompt_type="code" if i % 2 else "poetry")).speculation.num_steps
    with pytest.raises(grpc.RpcError):
        worker.gen.Generate(pb.GenerateRequest(prompt_token_ids=[]))
    wait_idle(worker)
    m = scrape(worker)
    for name in ["spec_decode_acceptance_rate", "spec_decode_avg_accepted_tokens",
                 "spec_decode_draft_k_distribution_bucket", "spec_decode_tree_branch_factor",
                 "spec_decode_total_speedup_ratio", "spec_decode_num_drafts_total",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "spec_decode_time_to_first_token_seconds_bucket", "spec_decode_time_per_output_token_seconds_bucket",
                 "spec_decode_e2e_request_latency_seconds_bucket", "spec_decode_queue_depth",
                 "spec_decode_running_requests", "spec_decode_kv_blocks_used", "spec_decode_rejected_requests_total",
                 "spec_decode_failed_requests_total", "spec_decode_requests_total",
                 "spec_decode_draft_failures_total"]:
        assert name in m, name

    def value(name, **labels):
        return sum(s.value for s in m[name] if all(s.labels.get(k) == v for k, v in labels.items()))

    stats = worker.stats()
    assert value("spec_decode_requests_total") == n
    assert value("spec_decode_generation_tokens_total") == n * 200  # the prefill's first token included
    assert value("spec_decode_e2e_request_latency_seconds_count") == n
    assert value("spec_decode_num_draft_tokens_total") == stats.num_draft_tokens > 0
    assert value("spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens > 0
    assert value("spec_decode_num_accepted_tokens_per_pos_total") == stats.num_accepted_tokens
    assert value("spec_decode_rejected_requests_total", reason="invalid") == 1
    assert value("spec_decode_draft_k_distribution_count") == steps  # one K per decoding step
    assert value("spec_decode_kv_blocks_used") == 0 and value("spec_decode_queue_depth") == 0
    # the router's prompt types are labels; anything else a client sends is "other" (no label minted)
    assert {s.labels["prompt_type"] for s in m["spec_decode_acceptance_rate"]} == {"code", "other"}
    assert value("spec_decode_tree_branch_factor") == 1
    assert value("spec_decode_total_speedup_ratio", quantization="none") > 0


def test_traces_follow_genai_conventions_and_continue_the_callers_trace(worker):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    md = [("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01")]
    worker.gen.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=12, top_p=0.5, temperature=0.5,
                                           seed=1, request_id="traced"), metadata=md)
    [span] = [s for s in worker.exporter.get_finished_spans() if s.attributes.get("gen_ai.request.id") == "traced"]
    a = span.attributes
    assert span.name == "text_completion tiny-random"
    assert format(span.context.trace_id, "032x") == trace_id and span.parent.span_id == 0x00f067aa0ba902b7
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "tiny-random"
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"]) == (12, 0.5, 0.5)
    assert a["gen_ai.usage.input_tokens"] == len(PROMPT) and a["gen_ai.usage.output_tokens"] <= 12
    assert tuple(a["gen_ai.response.finish_reasons"])[0] in ("stop", "length")
    for key in ("specfleet.speculation.method", "specfleet.speculation.k", "specfleet.speculation.accepted_tokens",
                "specfleet.speculation.alpha"):
        assert key in a, key


def test_logs_are_json_lines_with_the_request_id(worker):
    buf = io.StringIO()
    handler = logs.configure("INFO", buf)
    try:
        worker.gen.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=3, request_id="log-me"))
        with pytest.raises(grpc.RpcError):
            worker.gen.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=-1, request_id="bad-one"))
    finally:
        logging.getLogger("specfleet").removeHandler(handler)
    records = [json.loads(line) for line in buf.getvalue().splitlines()]
    done = [r for r in records if r.get("request_id") == "log-me"]
    assert done and done[-1]["msg"] == "request finished" and done[-1]["output_tokens"] == 3
    assert any(r.get("request_id") == "bad-one" and "max_tokens" in r["error"] for r in records)


def test_admin_is_served_on_its_own_port_only():
    # UpdateConfig turns speculation off and moves K, unauthenticated: the public port must not serve it
    with running_worker() as r:
        assert r.server.admin_port not in (0, r.server.grpc_port, r.server.http_port)
        public_admin = pb_grpc.AdminStub(r.channel)
        for call, req in ((public_admin.UpdateConfig, pb.UpdateConfigRequest(speculation_enabled=False)),
                          (public_admin.GetStats, pb.GetStatsRequest())):
            with pytest.raises(grpc.RpcError) as e:
                call(req, timeout=TIMEOUT_S)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert r.admin.GetConfig(pb.GetConfigRequest(), timeout=TIMEOUT_S).speculation_enabled  # refused: no change
        assert not r.admin.UpdateConfig(pb.UpdateConfigRequest(speculation_enabled=False),
                                        timeout=TIMEOUT_S).speculation_enabled
        refl = reflection_pb2_grpc.ServerReflectionStub(r.admin_channel)
        answer = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                timeout=TIMEOUT_S))
        assert "specfleet.v1.Admin" in {s.name for s in answer.list_services_response.service}

