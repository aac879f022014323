"""Mixed drafts (proposers/mixed.py): the n-gram's chain and a head's tree as one tree, each node
carrying the q it was drawn from. Exactness end to end: test_lossless_sampling.py; greedy
equality in a batch: test_lossless_greedy.py."""

import doctest

import pytest
import torch

from specfleet_engine.proposers import Capabilities, MixedProposer, NgramProposer, Proposal
from specfleet_engine.proposers import mixed
from specfleet_engine.sampling import SamplingParams


def test_the_doctests():
    assert doctest.testmod(mixed).failed == 0


def test_q_rows_are_one_hot_on_the_chain_and_leave_the_ngram_token_out_beside_it():
    # the head drew 7, then 5 at the root (q without 7 for the second), 6 under its 5
    q = torch.tensor([[0.1, 0.0, 0.0, 0.0, 0.2, 0.3, 0.0, 0.4],
                      [1 / 6, 0.0, 0.0, 0.0, 2 / 6, 3 / 6, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    head = Proposal([7, 5, 6], q, parents=[-1, -1, 1])
    out = mixed.mix(Proposal([5, 4], None, key=2), head, width=2)
    assert (out.draft_tokens, out.parents, out.key, out.ngram) == ([5, 4, 6, 7], [-1, 0, 0, -1], 2, 2)
    torch.testing.assert_close(out.draft_probs[0], torch.eye(8)[5])  # the head's 5 is the n-gram's node now
    torch.testing.assert_close(out.draft_probs[1], torch.eye(8)[4])
    torch.testing.assert_close(out.draft_probs[2], torch.eye(8)[6])  # beside the 4: 4 held no mass anyway
    torch.testing.assert_close(out.draft_probs[3], torch.tensor([0.2, 0, 0, 0, 0.4, 0, 0, 0.8]) / 1.4)  # 5 left out
    assert torch.allclose(out.draft_probs.sum(-1), torch.ones(4))


def test_greedy_heads_give_q_none_and_no_chain_gives_the_heads_draft_unchanged():
    head = Proposal([3, 4], None, parents=[-1, -1])
    assert mixed.mix(Proposal([], None), head, 2) is head
    out = mixed.mix(Proposal([4, 9], None, key=1), head, 2)
    assert (out.draft_tokens, out.parents, out.draft_probs, out.ngram) == ([4, 9, 3], [-1, 0, -1], None, 2)
    alone = mixed.mix(Proposal([4, 9], None, key=1), Proposal([], None), 2)
    assert (alone.draft_tokens, alone.parents, alone.ngram, alone.key) == ([4, 9], None, 2, 1)


def test_cutting_a_mixed_draft_keeps_count_of_its_chain():
    p = Proposal([5, 6, 9, 7, 8], None, key=2, parents=[-1, 0, 0, -1, 3], ngram=2)
    assert p.trimmed(1).ngram == 1 and p.subset([0, 2, 3]).ngram == 1 and p.subset([3, 4]).ngram == 0
    assert p.subset([0, 1, 3]).ngram == 2


class Head:
    """A head proposer that drafts a fixed tree and records what it was asked."""

    name, capabilities = "eagle", Capabilities(cheap=False, trees=True, target_layers=(1,))

    def __init__(self):
        self.asked, self.events = [], []

    def propose(self, seqs, ks, branching=None):
        self.asked.append((list(ks), branching))
        return [Proposal([7, 8], None, parents=[-1, -1]) if k else Proposal([], None) for k in ks]

    def observe_features(self, seq, start, feats):
        self.events.append("features")

    def rollback(self, seq, n):
        self.events.append("rollback")

    def release(self, seq):
        self.events.append("release")


class Seq:
    def __init__(self, seq_id, tokens):
        self.seq_id, self.tokens, self.params, self.generator = seq_id, tokens, SamplingParams(), None

    def token_array(self):
        import numpy as np

        return np.asarray(self.tokens, dtype=np.int64)


def test_a_chain_cap_drafts_the_ngram_chain_where_it_matches_and_asks_the_head_for_the_rest():
    head = Head()
    proposer = MixedProposer(NgramProposer(), head)
    assert proposer.capabilities == Capabilities(cheap=False, trees=True, target_layers=(1,))
    seqs = [Seq(0, [1, 2, 3, 1, 2]), Seq(1, [1, 2, 3, 4])]  # the first repeats, the second does not
    chains = proposer.propose(seqs, [3, 3])
    assert head.asked == [([0, 3], None)]
    assert (chains[0].draft_tokens, chains[0].ngram, chains[0].key) == ([3, 1, 2], 3, 2)
    assert (chains[1].draft_tokens, chains[1].ngram) == ([7, 8], 0)
    trees = proposer.propose(seqs, [3, 3], [2, 2])
    assert head.asked[-1] == ([3, 3], [2, 2])
    assert (trees[0].draft_tokens, trees[0].parents, trees[0].ngram) == ([3, 1, 2, 7], [-1, 0, 1, -1], 3)
    assert trees[1].draft_tokens == [7, 8] and trees[1].ngram == 0
    proposer.observe_features(seqs[0], 0, torch.zeros(1, 4))
    proposer.rollback(seqs[0], 5)
    proposer.release(seqs[0])
    assert head.events == ["features", "rollback", "release"]


@pytest.mark.parametrize("width", [2, 3])
def test_siblings_are_distinct_and_capped(width):
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 9, (), generator=g))
        parents = [-1] + [int(torch.randint(-1, i, (), generator=g)) for i in range(1, n)]
        tokens = []
        for i, p in enumerate(parents):  # distinct among siblings, as every head drafts them
            taken = {tokens[j] for j in range(i) if parents[j] == p}
            tokens.append(min(set(range(6)) - taken))
        chain = torch.randint(0, 6, (int(torch.randint(1, 5, (), generator=g)),), generator=g).tolist()
        out_tokens, out_parents, source, excluded = mixed.mix_tree(chain, tokens, parents, width)
        assert out_tokens[:len(chain)] == chain and out_parents[:len(chain)] == list(range(-1, len(chain) - 1))
        for p in set(out_parents):
            kids = [out_tokens[i] for i, q in enumerate(out_parents) if q == p]
            assert len(kids) == len(set(kids)) <= width
        assert all(q < i for i, q in enumerate(out_parents))
        assert all(s < 0 or tokens[s] == t for s, t in zip(source, out_tokens))


def test_the_factory_mixes_the_ngram_proposer_into_every_head_sharing_it():
    from specfleet_engine.factory import mix_ngram

    ngram, head = NgramProposer(corpus_tokens=64), Head()
    proposers = mix_ngram({"ngram": ngram, "eagle": head})
    assert proposers["ngram"] is ngram and isinstance(proposers["eagle"], MixedProposer)
    assert proposers["eagle"].ngram is ngram and proposers["eagle"].head is head and proposers["eagle"].name == "eagle"
