"""The EAGLE head: the features the engine hands it, its two forwards, its file, and
`specfleet train-draft` end to end on the tiny model (lossless decoding with it is in
test_lossless_greedy.py and test_lossless_sampling.py)."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from specfleet_engine.draft_head import EagleHead, HeadConfig, HeadMismatch, load_head, save_head
from specfleet_engine.draft_training import (
    OPTIMIZER_FILE, TrainArgs, evaluate, float_embeddings, load_optimizer, load_target, main, read_prompts,
    save_optimizer, sequence_loss, split_prompts, split_rows, target_pass, unrolled_rows,
)
from specfleet_engine.engine import Engine
from specfleet_engine.kv_cache import BlockTable, PagedKVCache, batch_metadata
from specfleet_engine.proposers import Capabilities, Proposal
from specfleet_engine.proposers.eagle import EagleProposer
from specfleet_engine.sampling import SamplingParams
from specfleet_engine.testing import repeating_prompts, tiny_head, tiny_model


class Recording:
    """A proposer that reads layers 0 and 1 and keeps what it is handed, by position."""

    name = "rec"

    def __init__(self, layers=(1, 0)):
        self.capabilities = Capabilities(trees=True, target_layers=layers)
        self.seen: dict[int, dict[int, torch.Tensor]] = {}

    def observe_features(self, seq, start, feats):
        for i, row in enumerate(feats):
            self.seen.setdefault(seq.seq_id, {})[start + i] = row.clone()

    def propose(self, seqs, ks, branching=None):
        # drafts the target's own continuation when it can (the plain run's), so paths get accepted
        return [Proposal(list(self.script[len(s.tokens):len(s.tokens) + k]), None) for s, k in zip(seqs, ks)]

    def rollback(self, seq, n):
        pass

    def release(self, seq):
        pass


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole prompt", "chunked prefill"])
def test_the_engine_hands_the_features_of_every_prefilled_and_accepted_position(chunk):
    target = tiny_model(seed=1, scale=4.0)
    prompt = repeating_prompts(3)[2]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = Engine(target, proposers={}).generate(prompt, params, "none")
    rec = Recording()
    rec.script = plain.tokens + [0] * 8  # right drafts, then a wrong tail: accepted and rejected nodes
    engine = Engine(target, proposers={"rec": rec}, k_policy="fixed", prefill_chunk=chunk)
    seq = engine.generate(prompt, params, "rec", 4)
    assert seq.output == plain.output and seq.stats.num_accepted_tokens > 0
    (feats, _, _), = target_pass(target, (1, 0), [seq.tokens], 1)
    seen = rec.seen[seq.seq_id]
    # every position the target verified or prefilled, once (the last token is never fed)
    assert sorted(seen) == list(range(len(seq.tokens) - 1))
    for pos, row in seen.items():
        torch.testing.assert_close(row, feats[pos], rtol=1e-3, atol=1e-3)


def test_a_proposer_reading_layers_the_target_lacks_is_refused():
    with pytest.raises(ValueError, match=r"layers \[5\]; the target has 2 layers"):
        Engine(tiny_model(seed=1), proposers={"rec": Recording(layers=(0, 5))})
    with pytest.raises(ValueError, match="distinct"):
        Engine(tiny_model(seed=1), proposers={"rec": Recording(layers=(1, 1))})


def test_the_heads_serving_forward_is_its_training_forward():
    target = tiny_model(seed=2, scale=2.0)
    head = EagleHead(HeadConfig.for_target(target, 50), target.args).eval()
    n = 19
    emb, feature = torch.randn(n, target.args.dim), torch.randn(n, target.args.dim)
    cache = PagedKVCache.for_model(head.args, 64, 8)
    tokens, meta, _ = batch_metadata([BlockTable(cache)], [list(range(n))])
    with torch.no_grad():
        paged, hidden = head(emb, feature, meta, cache.layers)
        hidden_dense, _ = head.forward_dense(emb, feature, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
        dense = head.logits(hidden_dense)
    torch.testing.assert_close(paged, dense, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden, hidden_dense, rtol=1e-4, atol=1e-4)


def test_training_rows_attend_as_drafting_does():
    rows, mask = unrolled_rows(5, 3)
    at = {r: i for i, r in enumerate(rows)}
    # step 3 at t = 3 drafts from the target's features up to t = 1, then its own rows (2, 2), (3, 3)
    seen = {rows[i] for i in mask[at[(3, 3)]].nonzero().flatten().tolist()}
    assert seen == {(1, 0), (1, 1), (2, 2), (3, 3)}
    assert mask[at[(1, 2)]].sum() == 3  # step 1 is causal over the target's features


def reference_loss(head, embeddings, row, feats, top, probs, unroll, prompt_weight=0.0, prompt_from=0):
    """The training loss the plain way: every unrolled row in one forward under the whole mask;
    rows predicting the prompt's tokens past `prompt_from` weigh `prompt_weight`."""
    seq = row["prompt"] + row["output"]
    n, first = len(seq), max(0, len(row["prompt"]) - 2)
    start = min(first, max(0, prompt_from - 1)) if prompt_weight else first
    emb, fused = embeddings(torch.tensor(seq)).float(), head.fused(feats.float())
    rows, mask = unrolled_rows(n, unroll)
    index = {r: i for i, r in enumerate(rows)}
    hidden, out = None, []
    for j in range(1, unroll + 1):  # step j's rows read step j - 1's outputs: one more pass each
        t = torch.tensor([tt for _, tt in rows])
        feature = fused[t].clone()
        if hidden is not None:
            for i, (jj, tt) in enumerate(rows):
                if jj > 1:
                    feature[i] = hidden[index[(jj - 1, tt - 1)]]
        hidden, _ = head.forward_dense(emb[t + 1], feature, t, mask)
        use = [i for i, (jj, tt) in enumerate(rows) if jj == j and tt >= start]
        logp = torch.log_softmax(head.logits(hidden[use]), dim=-1)
        tt = t[use] + 1
        p = probs[tt].float()
        row_loss = -(p * logp.gather(1, top[tt].long())).sum(1) / p.sum(1)
        w = torch.tensor([1.0 if rows[i][1] >= first else prompt_weight for i in use])
        out.append((w * row_loss).sum() / w.sum())
    return out


@pytest.mark.parametrize("unroll", [1, 2, 3])
@pytest.mark.parametrize("prompt_weight, prompt_from", [(0.0, 0), (0.5, 3)])
def test_the_training_passes_give_the_plain_unrolled_loss_and_gradients(unroll, prompt_weight, prompt_from):
    target = tiny_model(seed=2, scale=2.0)
    vocab = target.args.vocab_size
    head = EagleHead(HeadConfig.for_target(target, vocab), target.args).float().init_from(target, torch.arange(vocab))
    emb = float_embeddings(target)
    for prompt_len in (1, 2, 7):  # the answer from the first position on, and after a prompt
        row = {"prompt": list(range(3, 3 + prompt_len)), "output": [5, 9, 2, 11, 4, 4, 8, 30, 1]}
        feats, top, probs = target_pass(target, head.config.feature_layers, [row["prompt"] + row["output"]], 4)[0]
        want = reference_loss(head, emb, row, feats, top, probs, unroll, prompt_weight, prompt_from)
        total, losses, _ = sequence_loss(head, emb, row, feats, top, probs, torch.arange(vocab), unroll,
                                         prompt_weight, prompt_from)
        if not prompt_weight:  # what it reports is the answer rows' loss
            assert losses == pytest.approx([float(x.detach()) for x in want], rel=1e-5, abs=1e-6)
        assert float(total) == pytest.approx(float(sum(x * 0.8 ** i for i, x in enumerate(want))), rel=1e-5)
        grads = torch.autograd.grad(total, [head.fuse.weight, head.layer.feed_forward.w2.weight])
        ref = torch.autograd.grad(sum(x * 0.8 ** i for i, x in enumerate(want)),
                                  [head.fuse.weight, head.layer.feed_forward.w2.weight])
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


def test_a_head_round_trips_and_a_head_for_another_target_is_refused(tmp_path):
    target = tiny_model(seed=2, scale=2.0)
    head = EagleHead(HeadConfig.for_target(target, 40), target.args).init_from(target, torch.arange(40) * 2)
    save_head(head, tmp_path / "h")
    back = load_head(tmp_path / "h", target)
    assert back.draft_vocab.tolist() == (torch.arange(40) * 2).tolist()
    bf16 = {k: v.to(torch.bfloat16).float() for k, v in head.state_dict().items() if v.is_floating_point()}
    for k, v in back.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(v, bf16[k])
    with pytest.raises(HeadMismatch, match="fingerprint"):
        load_head(tmp_path / "h", tiny_model(seed=3, scale=2.0))  # same shape, other weights
    with pytest.raises(HeadMismatch, match="vocabulary size 111, this target has 97"):
        load_head(tmp_path / "h", tiny_model(seed=2, vocab_size=97))
    with pytest.raises(HeadMismatch, match="hidden size 64, this target has 32"):
        load_head(tmp_path / "h", tiny_model(seed=2, dim=32, head_dim=8))
    (tmp_path / "bad").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_head(tmp_path / "bad", target)
    (tmp_path / "h" / "config.json").write_text(json.dumps({**head.config.to_json(), "extra": 1}))
    with pytest.raises(ValueError, match=r"unknown fields \['extra'\]"):
        load_head(tmp_path / "h", target)


def test_a_trained_heads_drafts_are_accepted_where_an_untrained_ones_are_not():
    target = tiny_model(seed=1, scale=4.0)
    prompts = repeating_prompts(6)
    trained = tiny_head(target, prompts)
    untrained = EagleHead(HeadConfig.for_target(target, 111), target.args).init_from(target, torch.arange(111)).eval()

    def acceptance(head):
        engine = Engine(target, proposers={"eagle": EagleProposer(head, target)}, k_policy="fixed")
        seqs = [engine.generate(p, SamplingParams(max_tokens=32, ignore_eos=True), "eagle", 4) for p in prompts]
        return sum(s.stats.num_accepted_tokens for s in seqs) / sum(s.stats.num_draft_tokens for s in seqs)

    good, bad = acceptance(trained), acceptance(untrained)
    assert good > 0.3 and good > 3 * bad, (good, bad)


# -- specfleet train-draft ---------------------------------------------------------------------

WORDS = "red blue cat dog sun moon tree fish bird rain snow wind".split()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`specfleet train-draft` on the tiny model: short prompts, seconds."""
    import random
    rng = random.Random(0)
    d = tmp_path_factory.mktemp("train-draft")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4)))})
                               + "\n" for i in range(48)))
    out = d / "head"
    argv = ["--target", "tiny-random", "--prompts", str(prompts), "--out", str(out), "--train-prompts", "40",
            "--eval-prompts", "4", "--max-new-tokens", "24", "--epochs", "8", "--train-batch", "2", "--sampled-share", "0.25",
            "--draft-vocab", "96", "--lr", "5e-3", "--eval-k", "3", "--prompt-weight", "0.3", "--val-share", "0.1"]
    assert main(argv) == 0
    return argv, out, prompts


def test_train_draft_writes_a_head_serving_loads_with_its_record(trained):
    argv, out, prompts = trained
    record = json.loads((out / "train-draft.json").read_text())
    assert record["train_prompts"] == 40 and record["answer_tokens"] > 0
    assert set(record["minutes"]) == {"distill_s", "features_s", "train_s", "eval_s"}
    assert record["eval"]["greedy_equal_plain"] == record["eval"]["prompts"] == 4
    assert (out / "train-draft.png").stat().st_size > 5000
    model, tokenizer = load_target("tiny-random")
    head = load_head(out, model)
    assert head.config.trained["eval"] == record["eval"] and len(head.draft_vocab) == 96
    curve = json.loads((out / "work" / "train.json").read_text())["curve"]
    first, last = curve[0]["loss"][0], sum(c["loss"][0] for c in curve[-10:]) / 10
    assert last < first - 0.5, (first, last)  # it learned
    held = [c for c in curve if "held_loss" in c]  # 4 answers it never trained on, checked along the way
    assert len(held) >= 10 and record["held_out"]["held_loss"] == held[-1]["held_loss"]
    assert held[-1]["held_loss"] != held[0]["held_loss"]  # measured on the head as it trains
    # on the answers it trained on, its first draft is the target's next token far more often than
    # an untrained head's
    a = TrainArgs("tiny-random", str(prompts), str(out), max_new_tokens=24, eval_k=3)
    train_ids, _ = split_prompts(read_prompts(prompts), 40, 4, 0)
    untrained = EagleHead(head.config, model.args).init_from(model, head.draft_vocab).eval()
    good = evaluate(a, model, tokenizer, head, read_prompts(prompts), train_ids[:8])
    print("trained", good)
    bad = evaluate(a, model, tokenizer, untrained, read_prompts(prompts), train_ids[:8])
    print("untrained", bad)
    assert good["acceptance_by_position"][0] > max(0.15, 2 * bad["acceptance_by_position"][0]), (good, bad)


def test_train_draft_resumes_and_refuses_to_mix_runs(trained, capsys):
    argv, out, _ = trained
    assert main(argv) == 2
    assert "pass --resume" in capsys.readouterr().err
    before = (out / "work" / "distill.jsonl").read_text()
    assert main(argv + ["--resume"]) == 0  # every stage's output is complete: nothing is redone
    said = capsys.readouterr().out
    assert "[distill] 40 answers on file: done" in said or "answers on file: done" in said
    assert "[features]" in said and "on file: done" in said
    assert (out / "work" / "distill.jsonl").read_text() == before
    # what a resume reads is safetensors and JSON: no pickle is written, so none is ever loaded
    assert (out / "work" / OPTIMIZER_FILE).exists() and not list((out / "work").glob("*.pt"))


def test_a_share_of_the_data_trains_on_fewer_answers_with_the_same_held_out_set(trained, tmp_path, capsys):
    argv, out, _ = trained
    work = tmp_path / "half" / "work"
    work.mkdir(parents=True)
    for name in ("distill.jsonl", "features.safetensors", "method"):  # the stages before training, reused
        shutil.copy(out / "work" / name, work / name)
    flags = dict(zip(argv[::2], argv[1::2]))
    flags.update({"--out": str(tmp_path / "half"), "--epochs": "1", "--train-share": "0.5"})
    capsys.readouterr()
    assert main([x for kv in flags.items() for x in kv] + ["--resume"]) == 0
    record = json.loads((tmp_path / "half" / "train-draft.json").read_text())
    full, half = (split_rows(40, TrainArgs("", "", "", val_share=0.1, train_share=s)) for s in (1.0, 0.5))
    assert half[1] == full[1] and not set(half[0]) & set(half[1])  # the same held-out answers, never trained on
    assert set(half[0]) <= set(full[0]) and len(half[0]) == round(len(full[0]) / 2)
    assert f"[train] {len(half[0])} sequences, {len(half[1])} held out" in capsys.readouterr().out
    rows = [json.loads(line) for line in (work / "distill.jsonl").read_text().splitlines()]
    assert record["train_share"] == 0.5
    assert record["trained_answer_tokens"] == sum(len(rows[r]["output"]) for r in half[0]) < record["answer_tokens"]


def test_the_optimizer_resumes_exactly_from_its_safetensors(tmp_path):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([w], lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        (w ** 2).sum().backward()
        opt.step()
    save_optimizer(opt, tmp_path / OPTIMIZER_FILE)
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = torch.optim.AdamW([w2], lr=0.05)
    opt2.load_state_dict(load_optimizer(tmp_path / OPTIMIZER_FILE, opt2))
    for p, o in ((w, opt), (w2, opt2)):  # the next step is the same as if it had never stopped
        o.zero_grad()
        (p ** 2).sum().backward()
        o.step()
    assert torch.equal(w, w2)


@pytest.mark.parametrize("args, message", [
    (["--prompts", "/nonexistent.jsonl"], "--prompts /nonexistent.jsonl: no such file"),
    (["--train-prompts", "0"], "--train-prompts must be >= 1"),
    (["--unroll", "0"], "--unroll must be >= 1"),
    (["--val-share", "1"], "--val-share must be in [0, 1), got 1.0"),
    (["--train-share", "0"], "--train-share must be in (0, 1], got 0.0"),
    (["--method", "medusa", "--prompt-weight", "0.5"], "--prompt-weight 0.5: a weight >= 0, for EAGLE heads"),
])
def test_train_draft_refuses_bad_arguments_naming_them(tmp_path, args, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    base = {"--target": "tiny-random", "--prompts": str(prompts), "--out": str(tmp_path / "o")}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = [x for kv in base.items() for x in kv]
    r = subprocess.run([sys.executable, "-m", "specfleet_cli.main", "train-draft", *argv], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr)


def test_the_doctests():
    import doctest

    from specfleet_engine import draft_head, draft_training
    from specfleet_engine.proposers import base
    for mod in (draft_head, draft_training, base):
        assert doctest.testmod(mod).failed == 0, mod.__name__


def test_the_worker_loads_a_head_and_judges_its_fit_from_the_files_headers(tmp_path):
    from specfleet_api.engine_config import EngineConfig
    from specfleet_engine.factory import eagle_proposer
    from specfleet_worker.main import head_problems

    target, _ = load_target("tiny-random")  # what the worker serves for tiny-random
    save_head(EagleHead(HeadConfig.for_target(target, 32), target.args), tmp_path / "fits")
    other = tiny_model(seed=0, vocab_size=97)
    save_head(EagleHead(HeadConfig.for_target(other, 32), other.args), tmp_path / "other")
    proposer = eagle_proposer(str(tmp_path / "fits"), target)
    assert proposer.capabilities.target_layers == (0, 1)
    with pytest.raises(HeadMismatch, match="vocabulary size 97, this target has 111"):
        eagle_proposer(str(tmp_path / "other"), target)
    cfg = EngineConfig(model_name="tiny-random", draft_method="eagle", draft_uri=str(tmp_path / "fits"))
    assert head_problems(cfg) == []
    bad = EngineConfig(model_name="tiny-random", draft_method="eagle", draft_uri=str(tmp_path / "other"))
    assert head_problems(bad) == ["draft.uri: the head does not fit the target: the head was trained for a target "
                                  "with vocabulary size 97, this target has 111"]
    missing = EngineConfig(model_name="tiny-random", draft_method="eagle", draft_uri=str(tmp_path / "none"))
    assert head_problems(missing) == [f"draft.uri: no draft head at {tmp_path / 'none'}: config.json is missing"]
