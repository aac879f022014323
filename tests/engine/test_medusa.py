"""Medusa heads: their forward, their file and its checks, the proposer's chains and trees, the
training loss, and `specfleet train-draft --method medusa` end to end on the tiny model (lossless
decoding with them is in test_lossless_greedy.py and test_lossless_sampling.py)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from specfleet_engine.draft_head import EagleHead, HeadConfig, HeadMismatch, save_head
from specfleet_engine.draft_training import (
    TrainArgs, evaluate, load_target, main, medusa_loss, read_prompts, split_prompts, target_pass,
)
from specfleet_engine.engine import Engine
from specfleet_engine.medusa_head import MedusaConfig, MedusaHead, load_medusa_head
from specfleet_engine.model import rms_norm
from specfleet_engine.proposers import Capabilities, TreeShape, proposer_class
from specfleet_engine.proposers.medusa import MedusaProposer
from specfleet_engine.sampling import SamplingParams
from specfleet_engine.testing import repeating_prompts, tiny_medusa_head, tiny_model


def test_each_head_is_a_residual_block_then_its_projection_mapped_to_the_targets_ids():
    target = tiny_model(seed=2, scale=2.0)
    torch.manual_seed(0)
    head = MedusaHead(MedusaConfig.for_target(target, 30, heads=3), target.args).eval()
    with torch.no_grad():
        head.draft_vocab.copy_(torch.arange(30) * 3)
        head.norm.weight.normal_()
    h = torch.randn(5, target.args.dim)
    with torch.no_grad():
        got = head(h)
        x = rms_norm(h, head.norm.weight, target.args.norm_eps)
        for i in range(3):
            w, b, out = head.blocks[i].weight, head.blocks[i].bias, head.outputs[i].weight
            torch.testing.assert_close(got[:, i], (x + torch.nn.functional.silu(x @ w.T + b)) @ out.T)
        assert head(h, 2).shape == (5, 2, 30)
        full = head.to_target_logits(got, target.args.vocab_size)
    assert full.shape == (5, 3, 111)
    assert torch.equal(full[:, :, ::3][:, :, :30], got) and torch.isinf(full[:, :, 1::3]).all()


def test_untrained_heads_start_as_the_targets_next_token():
    """Medusa's initialisation: identity blocks, the target's norm and LM-head rows."""
    target = tiny_model(seed=2, scale=2.0)
    head = MedusaHead(MedusaConfig.for_target(target, 111), target.args).init_from(target, torch.arange(111)).eval()
    seq = [3, 4, 5, 6, 7, 8]
    feats, top, _ = target_pass(target, head.config.feature_layers, [seq], 1)[0]
    with torch.no_grad():
        assert (head(feats).argmax(-1) == top).all()


def test_heads_round_trip_and_heads_for_another_target_are_refused_naming_what_differs(tmp_path):
    target = tiny_model(seed=2, scale=2.0)
    head = MedusaHead(MedusaConfig.for_target(target, 40, heads=3), target.args).init_from(target, torch.arange(40) * 2)
    save_head(head, tmp_path / "h")
    assert json.loads((tmp_path / "h" / "config.json").read_text())["format"] == "specfleet-medusa/1"
    back = load_medusa_head(tmp_path / "h", target)
    assert back.draft_vocab.tolist() == (torch.arange(40) * 2).tolist() and len(back.blocks) == 3
    for k, v in back.state_dict().items():
        if v.is_floating_point():
            torch.testing.assert_close(v, head.state_dict()[k].to(torch.bfloat16).float())
    with pytest.raises(HeadMismatch, match="fingerprint"):
        load_medusa_head(tmp_path / "h", tiny_model(seed=3, scale=2.0))  # same shape, other weights
    with pytest.raises(HeadMismatch, match="vocabulary size 111, this target has 97"):
        load_medusa_head(tmp_path / "h", tiny_model(seed=2, vocab_size=97))
    with pytest.raises(HeadMismatch, match="layers 2, this target has 3"):
        load_medusa_head(tmp_path / "h", tiny_model(seed=2, n_layers=3))
    # an EAGLE head is not Medusa heads, nor the other way round
    save_head(EagleHead(HeadConfig.for_target(target, 40), target.args), tmp_path / "eagle")
    with pytest.raises(HeadMismatch, match="'specfleet-eagle/1' head, where a 'specfleet-medusa/1' one is wanted"):
        load_medusa_head(tmp_path / "eagle", target)
    from specfleet_engine.draft_head import load_head
    with pytest.raises(HeadMismatch, match="'specfleet-medusa/1' head, where a 'specfleet-eagle/1' one"):
        load_head(tmp_path / "h", target)


def test_the_factory_builds_the_proposer_and_refuses_a_head_that_does_not_fit(tmp_path):
    from specfleet_engine.factory import medusa_proposer

    target, _ = load_target("tiny-random")
    save_head(MedusaHead(MedusaConfig.for_target(target, 32), target.args), tmp_path / "fits")
    other = tiny_model(seed=0, vocab_size=97)
    save_head(MedusaHead(MedusaConfig.for_target(other, 32), other.args), tmp_path / "other")
    proposer = medusa_proposer(str(tmp_path / "fits"), target)
    assert isinstance(proposer, proposer_class("medusa"))
    # the last layer's output (the final norm's input); one call whatever the length: cheap
    assert proposer.capabilities == Capabilities(cheap=True, trees=True, shapes=True, target_layers=(1,),
                                                 draft_stats=True)
    with pytest.raises(HeadMismatch, match="vocabulary size 97, this target has 111"):
        medusa_proposer(str(tmp_path / "other"), target)


class Fixed(torch.nn.Module):
    """Heads whose draft-vocabulary logits are given (the same for every sequence)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.tensor(logits, dtype=torch.float32)
        self.config = SimpleNamespace(heads=len(logits))
        self.device = torch.device("cpu")
        self.draft_vocab = torch.arange(len(logits[0]))  # the target's whole vocabulary

    def forward(self, hidden, heads=None):
        return self.logits[:heads].expand(hidden.shape[0], -1, -1)


def fixed_proposer(logits):
    target = tiny_model(seed=0, vocab_size=len(logits[0]))
    p = MedusaProposer(Fixed(logits), target)
    seq = SimpleNamespace(seq_id=7, tokens=[1, 2, 3], params=SamplingParams(), generator=None)
    p.observe_features(seq, 0, torch.zeros(2, target.args.dim))  # positions 0 and 1: ready
    return p, seq


LOGP = [[0.0, 2.0, 1.0, -1.0, -5.0],   # head 0: 1, then 2
        [3.0, 0.0, 0.0, 2.5, -5.0],    # head 1: 0, then 3
        [0.0, 0.0, 4.0, 0.0, 3.0]]     # head 2: 2, then 4


def test_a_chain_is_each_heads_top_token_and_needs_the_features_before_the_last_token():
    p, seq = fixed_proposer(LOGP)
    prop, = p.propose([seq], [5])
    assert prop.draft_tokens == [1, 0, 2] and prop.parents is None and prop.draft_probs is None
    assert p.propose([seq], [2])[0].draft_tokens == [1, 0]
    seq.tokens.append(4)  # a token whose preceding features have not come: nothing to draft from
    assert p.propose([seq], [3])[0].draft_tokens == []
    p.release(seq)
    assert p.features == {}


def test_a_tree_expands_the_most_probable_paths_first_within_the_budget():
    p, seq = fixed_proposer(LOGP)
    logp = torch.log_softmax(torch.tensor(LOGP), -1)
    prop, = p.propose([seq], [3], [2])
    paths = prop.rank_paths()
    # 2 + 2 x 2 x 2 = 10 nodes: the root's two children, then the best nodes' children
    assert len(prop.draft_tokens) == 10 and len(set(paths)) == 10
    assert [prop.draft_tokens[paths.index(x)] for x in [(0,), (1,), (0, 0), (0, 1)]] == [1, 2, 0, 3]
    score = {(): 0.0}
    for path, tok in zip(paths, prop.draft_tokens):  # each node's token is its rank in its head
        assert tok == [[1, 2], [0, 3], [2, 4]][len(path) - 1][path[-1]]
        score[path] = score[path[:-1]] + float(logp[len(path) - 1, tok])
    # every expanded node scores at least as high as any leaf left unexpanded at a lower depth
    expanded = {path[:-1] for path in paths if len(path) > 1}
    leaves = [x for x in paths if x not in expanded and len(x) < 3]
    assert min(score[x] for x in expanded if x) >= max(score[x] for x in leaves)
    # a static shape: its paths, no more
    shape = TreeShape.of([[0], [1], [0, 0], [0, 0, 0], [0, 0, 1]])
    prop, = p.propose([seq], [3], [2], shape)
    assert sorted(prop.rank_paths()) == sorted(shape.paths) and prop.draft_tokens[:3] == [1, 2, 0]


def test_a_sampled_draft_carries_the_q_each_node_was_drawn_from():
    p, seq = fixed_proposer(LOGP)
    seq.params = SamplingParams(temperature=1.0)
    seq.generator = torch.Generator().manual_seed(0)
    chain, = p.propose([seq], [3])
    q = torch.softmax(torch.tensor(LOGP), -1)
    torch.testing.assert_close(chain.draft_probs, q)
    tree, = p.propose([seq], [2], [2])
    for i, (par, r) in enumerate(zip(tree.parent_list(), tree.rank_paths())):
        d = len(r) - 1
        if r[-1] == 0:  # a first child: the head's q; a later sibling: what the earlier ones left
            torch.testing.assert_close(tree.draft_probs[i], q[d])
        else:
            left = q[d].clone()
            left[tree.draft_tokens[i - 1]] = 0
            torch.testing.assert_close(tree.draft_probs[i], left / left.sum())


def test_medusa_loss_is_each_heads_cross_entropy_on_the_answer():
    target = tiny_model(seed=2, scale=2.0)
    head = MedusaHead(MedusaConfig.for_target(target, 111, heads=3), target.args).float()
    vocab_row = torch.arange(111)
    for prompt_len in (1, 4):
        row = {"prompt": list(range(3, 3 + prompt_len)), "output": [5, 9, 2, 11, 4, 4, 8, 30, 1]}
        seq = row["prompt"] + row["output"]
        feats = target_pass(target, head.config.feature_layers, [seq], 1)[0][0]
        total, losses, _ = medusa_loss(head, row, feats, vocab_row)
        total = total.detach()
        logits = head(feats)
        want = []
        for i in range(3):
            t = [t for t in range(len(seq) - i - 2) if t + i + 2 >= prompt_len]
            want.append(torch.nn.functional.cross_entropy(logits[t, i], torch.tensor([seq[x + i + 2] for x in t])))
        assert losses == pytest.approx([float(x.detach()) for x in want], rel=1e-5)
        assert float(total) == pytest.approx(float(sum(x.detach() * 0.8 ** i for i, x in enumerate(want))), rel=1e-5)


def acceptance_by_position(target, head, prompts, k=3):
    engine = Engine(target, proposers={"medusa": MedusaProposer(head, target)}, k_policy="fixed")
    reached, accepted = [0] * k, [0] * k
    for p in prompts:
        s = engine.add(p, SamplingParams(max_tokens=32, ignore_eos=True), "medusa", k)
        while not s.finished:
            for out in engine.step():
                for i in range(out.stats.draft_depth if out.stats else 0):
                    reached[i] += 1
                    accepted[i] += i < out.stats.num_accepted
    return [a / r for a, r in zip(accepted, reached)]


def test_trained_heads_drafts_are_accepted_where_untrained_ones_are_not():
    target = tiny_model(seed=1, scale=4.0)
    prompts = repeating_prompts(6)
    trained = tiny_medusa_head(target, prompts)
    untrained = MedusaHead(trained.config, target.args).init_from(target, torch.arange(111)).eval()
    good, bad = acceptance_by_position(target, trained, prompts), acceptance_by_position(target, untrained, prompts)
    assert good[0] > 0.5 and good[0] > 3 * bad[0], (good, bad)


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole prompt", "chunked prefill"])
def test_greedy_medusa_matches_plain_decoding_after_a_chunked_prefill(chunk):
    target = tiny_model(seed=1, scale=4.0)
    prompts = repeating_prompts(4, seed=3)
    head = tiny_medusa_head(target, prompts, steps=60)
    engine = Engine(target, proposers={"medusa": MedusaProposer(head, target)}, k_policy="fixed", prefill_chunk=chunk,
                    tree_branching=2)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for p in prompts:
        plain = engine.generate(p, params, "none").output
        seq = engine.generate(p, params, "medusa", 4)
        assert seq.output == plain and seq.stats.num_accepted_tokens > 0 and seq.stats.draft_errors == 0


# -- specfleet train-draft --method medusa ---------------------------------------------------

WORDS = "red blue cat dog sun moon tree fish bird rain snow wind".split()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`specfleet train-draft --method medusa` on the tiny model: short prompts, seconds."""
    import random
    rng = random.Random(0)
    d = tmp_path_factory.mktemp("train-medusa")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4)))})
                               + "\n" for _ in range(48)))
    out = d / "heads"
    argv = ["--method", "medusa", "--target", "tiny-random", "--prompts", str(prompts), "--out", str(out),
            "--train-prompts", "40", "--eval-prompts", "4", "--max-new-tokens", "24", "--epochs", "8",
            "--train-batch", "2", "--sampled-share", "0.25", "--draft-vocab", "96", "--lr", "2e-2", "--heads", "3",
            "--eval-k", "5"]
    assert main(argv) == 0
    return argv, out, prompts


def test_train_draft_medusa_writes_heads_serving_loads_and_beats_untrained_heads(trained):
    argv, out, prompts = trained
    record = json.loads((out / "train-draft.json").read_text())
    assert record["train_prompts"] == 40 and record["heads"] == 3 and "unroll" not in record
    ev = record["eval"]
    assert ev["greedy_equal_plain"] == ev["prompts"] == 4 and ev["k"] == 3  # a chain: a token a head
    assert len(ev["acceptance_by_position"]) == 3 and ev["tau"] > 1
    model, tokenizer = load_target("tiny-random")
    head = load_medusa_head(out, model)
    assert head.config.trained["eval"] == ev and len(head.draft_vocab) == 96 and head.config.heads == 3
    curve = json.loads((out / "work" / "train.json").read_text())["curve"]
    assert len(curve[0]["loss"]) == 3
    first, last = curve[0]["loss"][0], sum(c["loss"][0] for c in curve[-10:]) / 10
    assert last < first - 0.5, (first, last)  # it learned
    a = TrainArgs("tiny-random", str(prompts), str(out), method="medusa", max_new_tokens=24, eval_k=3)
    train_ids, _ = split_prompts(read_prompts(prompts), 40, 4, 0)
    untrained = MedusaHead(head.config, model.args).init_from(model, head.draft_vocab).eval()
    good = evaluate(a, model, tokenizer, head, read_prompts(prompts), train_ids[:8])
    bad = evaluate(a, model, tokenizer, untrained, read_prompts(prompts), train_ids[:8])
    print("trained", good, "untrained", bad)
    assert good["acceptance_by_position"][0] > max(0.15, 2 * bad["acceptance_by_position"][0]), (good, bad)


def test_train_draft_medusa_resumes_and_refuses_to_mix_kinds_of_head(trained, capsys):
    argv, out, _ = trained
    assert main(argv) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert main(argv + ["--resume"]) == 0  # every stage's output is complete: nothing is redone
    said = capsys.readouterr().out
    assert "answers on file: done" in said and "[features]" in said and "on file: done" in said
    eagle = [x if x != "medusa" else "eagle" for x in argv] + ["--resume"]
    assert main(eagle) == 2
    assert "holds a medusa run: resume it with --method medusa" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--heads", "0"], "--heads must be >= 1, got 0"),
    (["--method", "hydra"], "argument --method: invalid choice: 'hydra'"),
    (["--heads", "two"], "argument --heads: invalid int value: 'two'"),
    (["--prompts", "/nonexistent.jsonl"], "--prompts /nonexistent.jsonl: no such file"),
])
def test_train_draft_medusa_refuses_bad_arguments_naming_them(tmp_path, args, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    base = {"--method": "medusa", "--target": "tiny-random", "--prompts": str(prompts), "--out": str(tmp_path / "o")}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = [x for kv in base.items() for x in kv]
    r = subprocess.run([sys.executable, "-m", "specfleet_cli.main", "train-draft", *argv], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and message in r.stderr, (r.returncode, r.stderr)
