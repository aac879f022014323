"""Generation.Score: teacher-forced log-probabilities of a given continuation, on a real worker
around the tiny model. Scoring what a greedy Generate produced gives Generate's own logprobs;
temperature, top_k and top_p define the scored distribution; bad input is INVALID_ARGUMENT
naming the field; scoring between steps leaves running requests untouched."""
from __future__ import annotations

import math
import threading

import grpc
import pytest

from specfleet_engine.proposers import default_proposers
from specfleet_worker.testing import CharTokenizer, SlowProposer, pb, running_worker, tiny_engine, wait_for, wait_idle

RPC_S = 30
PROMPT = [7] * 10  # the tiny model accepts n-gram drafts after it (checked below)


@pytest.fixture(scope="module")
def worker():
    with running_worker(tiny_engine(tokenizer=CharTokenizer())) as r:
        yield r


def score(r, tokens, context=PROMPT, **kw) -> list[float]:
    return list(r.gen.Score(pb.ScoreRequest(prompt_token_ids=context, token_ids=tokens, **kw), timeout=RPC_S).logprobs)


@pytest.mark.parametrize("method", ["none", "ngram"])
def test_scoring_a_greedy_answer_gives_generates_own_logprobs(worker, method):
    g = worker.gen.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=40, ignore_eos=True,
                                               logprobs=True, speculation_method=method), timeout=RPC_S)
    if method == "ngram":  # verify rows with accepted drafts, not only one-row steps
        assert g.speculation.num_accepted_tokens > 0
    resp = worker.gen.Score(pb.ScoreRequest(request_id="s-1", prompt_token_ids=PROMPT, token_ids=g.token_ids),
                            timeout=RPC_S)
    assert resp.request_id == "s-1" and resp.prompt_tokens == len(PROMPT)
    assert len(resp.logprobs) == len(g.logprobs) == 40
    assert max(abs(a - b) for a, b in zip(resp.logprobs, g.logprobs)) < 1e-4
    assert wait_idle(worker).kv_blocks_used == 0  # the job's blocks were freed


def test_the_context_may_be_text_or_messages_as_in_generate(worker):
    tok = CharTokenizer()
    tokens = tok.encode(" fine")
    by_ids = score(worker, tokens, tok.encode("How are you?"))
    assert score(worker, tokens, context=[], prompt="How are you?") == by_ids
    chat = worker.gen.Score(pb.ScoreRequest(messages=[pb.ChatMessage(role="user", content="How are you?")],
                                            token_ids=tokens), timeout=RPC_S)
    assert list(chat.logprobs) == score(worker, tokens, tok.chat("How are you?"))
    assert chat.prompt_tokens == len(tok.chat("How are you?"))


def test_temperature_top_k_and_top_p_define_the_scored_distribution(worker):
    vocab = worker.worker.vocab_size
    at = {}  # temperature -> log p(v) at the first position, for every v
    for t in (1.0, 0.5):
        at[t] = [score(worker, [v], temperature=t)[0] for v in range(vocab)]
        assert math.fsum(map(math.exp, at[t])) == pytest.approx(1.0, abs=1e-4)
    greedy = [score(worker, [v])[0] for v in range(vocab)]  # unset temperature: the softmax at T=1
    assert max(abs(a - b) for a, b in zip(greedy, at[1.0])) < 1e-5
    for v in (3, 50):  # T=0.5 doubles the log-odds
        assert at[0.5][v] - at[0.5][0] == pytest.approx(2 * (at[1.0][v] - at[1.0][0]), abs=1e-3)

    best = sorted(range(vocab), key=lambda v: -greedy[v])
    top3 = [score(worker, [v], temperature=1.0, top_k=3)[0] for v in range(vocab)]
    assert {v for v in range(vocab) if top3[v] > -math.inf} == set(best[:3])
    assert math.fsum(math.exp(x) for x in top3) == pytest.approx(1.0, abs=1e-4)

    nucleus = [score(worker, [v], temperature=1.0, top_p=0.3)[0] for v in range(vocab)]
    kept = [v for v in best if nucleus[v] > -math.inf]
    assert kept == best[:len(kept)]  # the most likely ones
    mass = math.fsum(math.exp(greedy[v]) for v in kept)
    assert mass >= 0.3 > mass - math.exp(greedy[kept[-1]])  # the smallest set that reaches top_p


BAD = [
    ("token_ids", dict(prompt_token_ids=[1, 2])),
    ("token_ids[1]", dict(prompt_token_ids=[1, 2], token_ids=[3, 111])),
    ("token_ids[0]", dict(prompt_token_ids=[1, 2], token_ids=[-1])),
    ("prompt", dict(token_ids=[3])),
    ("prompt, prompt_token_ids", dict(prompt="hi", prompt_token_ids=[1], token_ids=[3])),
    ("prompt_token_ids[0]", dict(prompt_token_ids=[500], token_ids=[3])),
    ("messages[0].role", dict(messages=[pb.ChatMessage(role="robot", content="x")], token_ids=[3])),
    ("prompt", dict(prompt_token_ids=[1] * 512, token_ids=[3])),
    ("token_ids", dict(prompt_token_ids=[1] * 500, token_ids=[3] * 20)),
    ("token_ids", dict(prompt_token_ids=[1], token_ids=[3] * 2049)),
    ("temperature", dict(prompt_token_ids=[1], token_ids=[3], temperature=-1)),
    ("top_k", dict(prompt_token_ids=[1], token_ids=[3], top_k=-2)),
    ("top_p", dict(prompt_token_ids=[1], token_ids=[3], top_p=1.5)),
    ("request_id", dict(request_id="x" * 129, prompt_token_ids=[1], token_ids=[3])),
]


@pytest.mark.parametrize("field, fields", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_is_invalid_argument_naming_the_field(worker, field, fields):
    with pytest.raises(grpc.RpcError) as e:
        worker.gen.Score(pb.ScoreRequest(**fields), timeout=RPC_S)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field), e.value.details()


def test_text_needs_a_tokenizer():
    with running_worker() as r, pytest.raises(grpc.RpcError) as e:
        r.gen.Score(pb.ScoreRequest(prompt="hi", token_ids=[3]), timeout=RPC_S)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("prompt")


def test_scoring_during_a_load_changes_neither_the_answers_nor_the_scores():
    proposers = {**default_proposers(), "slow": SlowProposer(0.004)}  # keeps the batch running a while
    prompts = [[1 + i, 2, 3] * 4 for i in range(8)]
    with running_worker(tiny_engine(proposers=proposers), max_batch_size=4) as r:
        threads_seen = set()  # the engine has one owner: scoring runs on the scheduler thread, between steps
        engine_score = r.engine.score

        def spied_score(*args):
            threads_seen.add(threading.current_thread().name)
            return engine_score(*args)

        r.engine.score = spied_score

        def generate(p):
            return r.gen.Generate(pb.GenerateRequest(prompt_token_ids=p, max_tokens=60, ignore_eos=True,
                                                     speculation_method="slow"), timeout=RPC_S).token_ids

        alone = [list(generate(p)) for p in prompts]
        scores_alone = [score(r, a, p) for p, a in zip(prompts, alone)]
        got: dict[int, list[int]] = {}
        errors: list[BaseException] = []

        def client(i):
            try:
                got[i] = list(generate(prompts[i]))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        wait_for(lambda: r.worker.scheduler.running() == 4, 10, "a full running batch")
        during, scored = 0, []
        for i in range(len(prompts) * 2):
            busy = r.worker.scheduler.running() > 0
            scored.append(score(r, alone[i % len(prompts)], prompts[i % len(prompts)]))
            during += busy and r.worker.scheduler.running() > 0
        for t in threads:
            t.join(RPC_S)
        assert not errors, errors
        assert threads_seen == {r.worker.scheduler.thread.name}
        assert during >= 4, "the scores did not run beside a batch"
        assert [got[i] for i in range(len(prompts))] == alone
        for i, s in enumerate(scored):
            assert max(abs(a - b) for a, b in zip(s, scores_alone[i % len(prompts)])) < 1e-5
        assert wait_idle(r).kv_blocks_used == 0
