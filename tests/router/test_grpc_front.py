"""The router's gRPC front: the worker's own API (specfleet.v1.Generation) with the router's
routing, the route in the initial metadata, the worker's status codes passed on."""
from __future__ import annotations

import grpc
import pytest

from specfleet_proto import worker_pb2 as pb
from specfleet_proto import worker_pb2_grpc as pb_grpc
from specfleet_worker.testing import wait_idle


@pytest.fixture()
def stub(router):
    with grpc.insecure_channel(router.grpc_target) as channel:
        yield pb_grpc.GenerationStub(channel)


def test_unary_and_streaming_through_the_router_equal_the_worker(router, worker, stub):
    req = pb.GenerateRequest(prompt="Solve 12 * 7 = ?", max_tokens=10, temperature=0)
    want = worker.gen.Generate(req, timeout=30)
    resp, call = stub.Generate.with_call(req, timeout=30)
    assert (resp.text, list(resp.token_ids)) == (want.text, list(want.token_ids))
    md = dict(call.initial_metadata())
    assert (md["x-specfleet-arm"], md["x-specfleet-method"], md["x-specfleet-prompt-type"]) == (
        "stable", "ngram", "math")
    assert resp.speculation.method == "ngram"  # what the router sent is what the worker ran

    stream = stub.GenerateStream(req, timeout=30)
    assert dict(stream.initial_metadata())["x-specfleet-prompt-type"] == "math"
    parts = list(stream)
    assert "".join(p.text for p in parts) == want.text and parts[-1].finish_reason == "length"
    assert [t for p in parts for t in p.token_ids] == list(want.token_ids)


def test_chat_messages_are_classified_and_a_callers_own_type_and_method_are_kept(router, stub):
    msgs = [pb.ChatMessage(role="user", content="Translate into French: good morning")]
    _, call = stub.Generate.with_call(pb.GenerateRequest(messages=msgs, max_tokens=3), timeout=30)
    assert dict(call.initial_metadata())["x-specfleet-prompt-type"] == "translation"
    resp, call = stub.Generate.with_call(pb.GenerateRequest(messages=msgs, max_tokens=3, prompt_type="rag",
                                                            speculation_method="none"), timeout=30)
    assert dict(call.initial_metadata())["x-specfleet-prompt-type"] == "rag"
    assert dict(call.initial_metadata())["x-specfleet-method"] == "none"  # the route says it (a vLLM arm: its pool)
    assert resp.speculation.method == "none"


def test_the_workers_status_codes_come_back(router, stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(prompt="Hi", max_tokens=0), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("max_tokens")
    with pytest.raises(grpc.RpcError) as e:
        list(stub.GenerateStream(pb.GenerateRequest(prompt_token_ids=[1, 99999], max_tokens=2), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids[1]" in e.value.details()


def test_a_callers_deadline_reaches_the_worker(h):
    with h.text_worker(proposers={"ngram": h.SlowProposer(0.02)}) as w, h.router_over([w]) as r, \
            grpc.insecure_channel(r.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(prompt="Hi", max_tokens=400, ignore_eos=True),
                                                     timeout=0.3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        stats = wait_idle(w)
        assert (stats.running, stats.kv_blocks_used) == (0, 0)


def test_no_ready_backend_is_unavailable(h):
    from specfleet_local.redis_server import free_port

    with h.router_over([f"127.0.0.1:{free_port()}"]) as r, grpc.insecure_channel(r.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(prompt="Hi", max_tokens=2), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no ready backend" in e.value.details()
        assert dict(e.value.initial_metadata())["x-specfleet-arm"] == "stable"


def test_trace_context_in_metadata_passes_through(router, worker, stub):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    stub.Generate(pb.GenerateRequest(prompt="Hi", max_tokens=2), timeout=30,
                  metadata=[("traceparent", f"00-{trace_id}-b7ad6b7169203331-01")])
    assert any(format(s.context.trace_id, "032x") == trace_id for s in worker.exporter.get_finished_spans())
