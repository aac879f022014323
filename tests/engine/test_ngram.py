import doctest

import numpy as np
import pytest

from specfleet_engine.proposers import ngram


def test_docstring_examples():
    assert doctest.testmod(ngram).failed == 0


def test_longest_match_wins_over_a_later_shorter_one():
    # the last 3 tokens (1 2 3) occur at 0; the last 1 token (3) also occurs later at 5
    tokens = np.array([1, 2, 3, 7, 8, 3, 9, 1, 2, 3])
    assert ngram.ngram_propose(tokens, 1, 3, 2).tolist() == [7, 8]


def test_draft_is_cut_at_the_end_of_the_context():
    tokens = np.array([4, 5, 4])
    assert ngram.ngram_propose(tokens, 1, 2, 5).tolist() == [5, 4]


def test_min_n_bounds_the_match_length():
    tokens = np.array([1, 9, 2, 9])
    assert ngram.ngram_propose(tokens, 2, 3, 2).tolist() == []
    assert ngram.ngram_propose(tokens, 1, 3, 2).tolist() == [2, 9]


def test_match_length_is_reported_as_the_proposal_key():
    tokens = np.array([1, 2, 3, 7, 8, 3, 9, 1, 2, 3])
    draft, n = ngram.ngram_match(tokens, 1, 4, 2)
    assert draft.tolist() == [7, 8] and n == 3
    assert ngram.ngram_match(np.array([1, 2, 3]), 1, 2, 4)[1] == 0


def test_adaptive_k_keeps_separate_acceptance_per_match_length():
    from specfleet_engine.engine import Engine
    from specfleet_engine.sampling import SamplingParams
    from specfleet_engine.testing import tiny_model

    engine = Engine(tiny_model(seed=1, scale=4.0))
    engine.costs.seconds.update({r: 1.0 + 0.1 * (r - 1) for r in range(1, 32)})
    seq = engine.generate([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True), "ngram", 6)
    by_key = seq.kstate.by_key  # the adaptive policy's acceptance, per kind of draft
    assert by_key and all(k >= 0 for k in by_key)
    assert any(k > 0 for k in by_key), "drafts from matches were tracked under their match length"


class Finished:
    """A finished request as the proposer's release() sees it."""

    def __init__(self, tokens):
        self.tokens = list(tokens)

    def token_array(self):
        return np.asarray(self.tokens, dtype=np.int64)


def test_the_corpus_drafts_what_an_earlier_request_continued_with():
    alone, shared = ngram.NgramProposer(), ngram.NgramProposer(corpus_tokens=64)
    for p in (alone, shared):
        p.release(Finished([1, 2, 3, 4, 5, 6]))
    seq = Finished([9, 2, 3])
    assert alone.propose([seq], [3])[0].draft_tokens == []
    assert shared.propose([seq], [3])[0].draft_tokens == [4, 5, 6]
    tree = shared.propose([seq], [3], branching=[2])[0]
    assert tree.draft_tokens == [4, 5, 6] and tree.key == 2


def test_a_corpus_continuation_never_crosses_into_the_next_request():
    p = ngram.NgramProposer(corpus_tokens=64)
    p.release(Finished([5, 1, 2]))  # "1 2" ends this request: it continues nowhere
    p.release(Finished([3, 4, 1]))  # "1" continues nowhere either
    seq = Finished([9, 1, 2])
    assert p.propose([seq], [4])[0].draft_tokens == []
    assert p.propose([seq], [4], branching=[4])[0].draft_tokens == []
    p.release(Finished([7, 2, 6, 6]))
    assert p.propose([seq], [4])[0].draft_tokens == [6, 6]  # cut where that request ended
    assert p.propose([Finished([8, 2])], [4], branching=[3])[0].draft_tokens == [6, 6]


def test_the_context_counts_as_later_than_the_corpus():
    p = ngram.NgramProposer(corpus_tokens=64)
    p.release(Finished([1, 2, 7, 7]))
    seq = Finished([1, 2, 8, 4, 1, 2])  # "1 2" went on with 7 in the corpus, 8 here: a tie
    assert p.propose([seq], [1])[0].draft_tokens == [8]
    tree = p.propose([seq], [2], branching=[2])[0]
    assert tree.draft_tokens[0] == 8 and 7 in tree.draft_tokens  # both, the context's first


def test_the_oldest_requests_leave_the_corpus_first():
    p = ngram.NgramProposer(corpus_tokens=8)
    for doc in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        p.release(Finished(doc))  # each takes 5 with its end marker
    assert p.corpus.tokens.tolist() == [9, 10, 11, 12, -1]
    p.release(Finished(range(100, 120)))  # longer than the corpus: its tail
    assert p.corpus.tokens.tolist() == [*range(113, 120), -1]
    off = ngram.NgramProposer()
    off.release(Finished([1, 2, 3]))
    assert off.corpus is None


def test_a_corpus_speeds_up_a_repeated_request_and_changes_no_token():
    """Lossless with the corpus (chains and trees): a request repeating an earlier one drafts
    from that one's output, and the greedy output is plain decoding's."""
    from specfleet_engine.engine import Engine
    from specfleet_engine.sampling import SamplingParams
    from specfleet_engine.testing import tiny_model

    model = tiny_model(seed=3, scale=4.0)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    prompt = [11, 3, 27, 8, 40, 2, 19]
    plain = Engine(model).generate(prompt, params, "none").output
    for branching in (1, 3):
        accepted = {}
        for corpus in (0, 4096):
            engine = Engine(model, proposers={"ngram": ngram.NgramProposer(corpus_tokens=corpus)}, k_policy="fixed",
                            tree_branching=branching)
            first = engine.generate(prompt, params, "ngram", 4)
            again = engine.generate(prompt, params, "ngram", 4)  # a retry: every token is in the corpus
            assert first.output == plain and again.output == plain, (branching, corpus)
            accepted[corpus] = again.stats.num_accepted_tokens
        assert accepted[4096] >= 24 > accepted[0], (branching, accepted)


def test_the_corpus_index_finds_what_a_scan_finds():
    """Corpus.find (a hash index) against a brute-force scan of corpus + context, on a small
    vocabulary so that most n-grams repeat; the eviction path rebuilds the index."""
    rng = np.random.default_rng(7)
    corpus = ngram.Corpus(300, 1, 4)
    for _ in range(12):
        corpus.add(rng.integers(0, 5, rng.integers(1, 60)))
        context = rng.integers(0, 5, rng.integers(1, 30))
        tokens = np.concatenate([corpus.tokens, context])
        L = tokens.size
        for n in range(1, min(4, context.size) + 1):
            pattern = tokens[L - n:]
            scan = [i for i in range(L - n) if (tokens[i:i + n] == pattern).all() and tokens[i + n] >= 0
                    and (i >= corpus.size or (tokens[i:i + n] >= 0).all())]
            assert ngram._hits(tokens, n, corpus).tolist() == scan, n


class Running(Finished):
    """A request being decoded, as the proposer sees it."""

    def __init__(self, tokens, seq_id=1):
        super().__init__(tokens)
        self.seq_id = seq_id


def test_recycled_trees_offer_the_targets_other_choices_beside_the_matches():
    """Token Recycling: the target's second choices after a token become siblings of the match's
    continuation (tried after it), and a node the matches do not continue gets the target's own
    choices; without them the tree is the matches' alone."""
    p = ngram.NgramProposer(recycle=3)
    seq = Running([7, 5, 6, 5])  # "5" went on with 6, 5, where the context ends
    plain = p.propose([seq], [3], branching=[3])[0]
    assert (plain.draft_tokens, plain.parents) == ([6, 5], [-1, 0])
    p.observe_targets(seq, [5, 6], np.array([[6, 7, 8], [5, 1, 2]]))  # after 5: 6, then 7, then 8
    tree = p.propose([seq], [3], branching=[3])[0]
    nodes = list(zip(tree.draft_tokens, tree.parents))
    assert nodes[:2] == [(6, -1), (5, 0)]  # the match's chain first
    assert (7, -1) in nodes and (8, -1) in nodes  # the target's 2nd and 3rd choices after 5, at the root
    assert nodes.index((7, -1)) < nodes.index((8, -1))  # tried in the target's order
    assert (6, 1) in nodes  # past the match's end, the target's first choice after 5 goes on
    assert (1, 0) in nodes  # and its second after 6 beside the match's 5
    assert len(nodes) == len(set(nodes))  # no sibling twice
    assert all(par < i for i, par in enumerate(tree.parents))  # parents first
    assert max(tree.depths()) == 3
    chain = p.propose([seq], [3])[0]
    assert chain.draft_tokens == [6, 5, 6]  # a chain: the match, then the target's first choice
    p.release(seq)
    assert p.successors == {} and p.propose([seq], [3], branching=[3])[0].draft_tokens == [6, 5]


def test_recycling_is_bounded_and_off_by_default():
    assert ngram.NgramProposer().recycle == 0
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="recycle"):
            ngram.NgramProposer(recycle=bad)


class Recording(ngram.NgramProposer):
    def __init__(self):
        super().__init__(recycle=2)
        self.seen = []  # (seq_id, position of tokens[0], tokens, the target's first choices)

    def observe_targets(self, seq, tokens, top):
        self.seen.append((seq.seq_id, len(seq.tokens) - 1, list(tokens), top[:, 0].tolist()))
        super().observe_targets(seq, tokens, top)


@pytest.mark.parametrize("branching", [1, 3], ids=["chains", "trees"])
def test_the_engine_hands_over_the_targets_choices_after_each_accepted_token(branching):
    """In a batch, after the prefill and after every verify step, each request's proposer sees its
    accepted path (the step's root, then the accepted drafts) with the target's top choices
    after each: greedy, the first is the token that came next. Outputs stay plain decoding's."""
    from specfleet_engine.engine import Engine
    from specfleet_engine.sampling import SamplingParams
    from specfleet_engine.testing import repeating_prompts, tiny_model

    model = tiny_model(seed=1, scale=4.0)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = repeating_prompts(3)
    plain = [Engine(model).generate(pr, params, "none").output for pr in prompts]
    proposer = Recording()
    engine = Engine(model, proposers={"ngram": proposer}, k_policy="fixed", tree_branching=branching)
    seqs = [engine.add(pr, params, "ngram", 4) for pr in prompts]
    for _ in range(200):
        if all(s.finished for s in seqs):
            break
        engine.step()
    assert [s.output for s in seqs] == plain
    by_id = {s.seq_id: s for s in seqs}
    checked = accepted = 0
    for seq_id, at, tokens, first in proposer.seen:
        full = by_id[seq_id].tokens
        assert full[at:at + len(tokens)] == tokens, (at, tokens)
        for i, tok in enumerate(first):
            if at + i + 1 < len(full):
                assert full[at + i + 1] == tok, (at, i)
                checked += 1
        accepted += len(tokens) - 1
    assert checked >= sum(len(s.output) for s in seqs) - len(seqs)  # every emitted token's predecessor seen
    assert accepted > 0, "no draft was accepted: only roots were checked"
    assert proposer.successors == {}  # released with the requests
