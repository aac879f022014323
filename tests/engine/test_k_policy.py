"""K policies: the expected-tokens arithmetic, the cost-aware choice over a batch, the adaptive
ceiling (alpha drives K, a larger batch shrinks it, hysteresis, bounds bind at once, K = 0
probes), the fixed policy, and K_min honoured by an adaptive engine."""
from __future__ import annotations

import doctest
import random
from types import SimpleNamespace

import pytest

from specfleet_engine import k_policies
from specfleet_engine.costs import StepCostModel
from specfleet_engine.proposers import Capabilities, Proposal
from specfleet_engine.k_policies import AdaptivePolicy, FixedPolicy, best_k, choose_ks, expected_tokens, make_policy
from specfleet_engine.k_policies import adaptive, base


def linear_costs(a: float, b: float) -> StepCostModel:
    """A calibrated curve t(n) = a + b n up to 200 rows."""
    c = StepCostModel()
    c.set_curve({n: a + b * n for n in range(1, 201)})
    return c


def seq(k: int = 4, k_min: int = 0, k_max: int = 8):
    return SimpleNamespace(k=k, k_min=k_min, k_max=k_max, kstate=None)


def test_docstring_examples():
    for mod in (k_policies, base, adaptive):
        assert doctest.testmod(mod).failed == 0


def test_every_api_policy_has_an_implementation():
    from specfleet_api.enums import K_POLICIES

    costs = linear_costs(1.0, 0.1)
    assert [make_policy(name, costs).name for name in K_POLICIES] == list(K_POLICIES)
    with pytest.raises(ValueError, match="kPolicy must be one of"):
        make_policy("eagle2", costs)


def test_expected_tokens_is_the_geometric_series():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.0, 8) == 1.0 and expected_tokens(1.0, 3) == 4.0


def test_a_bigger_batch_drafts_less():
    # on a CPU each row costs ~15% of a step; per-row cost stays flat as the batch grows
    cost = lambda rows: 1.0 + 0.15 * (rows - 1)  # noqa: E731
    alone = sum(choose_ks([0.6], [8], cost))
    batch = choose_ks([0.6] * 16, [8] * 16, cost)
    assert alone >= 2 and sum(batch) / 16 < alone


def test_low_acceptance_turns_speculation_off_and_high_turns_it_on():
    cost = lambda rows: 1.0 + 0.3 * (rows - 1)  # noqa: E731
    assert choose_ks([0.2], [8], cost) == [0]
    assert choose_ks([0.9], [8], cost)[0] >= 3


def test_best_k_grows_with_alpha_and_shrinks_to_zero_as_the_batch_grows():
    cost = linear_costs(0.02, 0.001)  # a 20-token step costs twice a 1-token one
    ks_by_alpha = [best_k(alpha, 1, 0, 8, cost)[0] for alpha in (0.1, 0.5, 0.8, 0.95)]
    assert ks_by_alpha == sorted(ks_by_alpha) and ks_by_alpha[0] <= 1 and ks_by_alpha[-1] >= 5
    ks_by_batch = [best_k(0.7, batch, 0, 8, cost)[0] for batch in (1, 4, 16, 64)]
    assert ks_by_batch == sorted(ks_by_batch, reverse=True) and ks_by_batch[0] >= 3 and ks_by_batch[-1] == 0


def run(policy: AdaptivePolicy, alpha: float, steps: int, batch: int = 1, k_min: int = 0, k_max: int = 8,
        seed: int = 0) -> list[int]:
    """A request whose draft tokens are each accepted with chance alpha; K (the ceiling) per step."""
    rng = random.Random(seed)
    s = seq(4, k_min, k_max)
    policy.start(s)
    ks = []
    for _ in range(steps):
        k = policy.ceiling(s, batch)
        ks.append(k)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        policy.observe(s, 0, k, accepted)
    return ks


def test_the_ceiling_climbs_on_high_acceptance_and_falls_on_low():
    cost = linear_costs(0.02, 0.001)
    assert run(AdaptivePolicy(cost), 0.9, 200)[-1] >= 6
    low = run(AdaptivePolicy(cost), 0.02, 200)
    assert max(low[-20:]) <= 1


def test_k_changes_one_step_at_a_time_and_rarely():
    ks = run(AdaptivePolicy(linear_costs(0.02, 0.001)), 0.6, 400)
    changes = sum(1 for a, b in zip(ks, ks[1:]) if a != b)
    assert all(abs(a - b) <= 1 for a, b in zip(ks, ks[1:]))
    assert changes <= 400 / 4 / 2  # hold = 4 steps between changes, and most holds end without one


def test_bounds_bind_at_once_and_a_fixed_policy_stays_put():
    p = AdaptivePolicy(linear_costs(0.02, 0.001))
    s = seq(6)
    p.start(s)
    s.k_max = 2
    assert p.ceiling(s, 1) == 2  # K_max lowered under the current K
    s.k_min, s.k_max = 3, 5
    assert p.ceiling(s, 1) == 3
    fixed = FixedPolicy()
    s = seq(4)
    fixed.start(s)
    for _ in range(50):
        assert fixed.draft_lengths([s], [8], lambda r: float(r), False, 64) == [4]
        assert fixed.select_nodes([s], [Proposal([1, 2, 3, 4], None)], lambda r: float(r), True, 1) == [[0, 1, 2, 3]]
        fixed.observe(s, 0, 4, 0)
    assert fixed.draft_lengths([s], [2], lambda r: 1.0, True, 1) == [2]  # never past the room left


def test_at_k_zero_the_ceiling_probes_to_re_measure_alpha():
    p = AdaptivePolicy(linear_costs(0.02, 0.005), probe_every=10)  # a draft token costs a quarter step
    ks = run(p, 0.0, 300)
    assert 0 in ks and ks.count(1) >= 5  # it dropped to 0 and came back up to look, several times


def test_a_prior_from_the_prompt_types_history_sets_the_first_k():
    p = AdaptivePolicy(linear_costs(0.02, 0.002))

    def first(prior=None, **bounds):
        s = seq(4, **bounds)
        p.start(s, prior)
        return s.k

    assert first() == 4  # no history: kInitial
    assert first(0.02) == 0  # this prompt type's drafts are rejected: do not draft
    assert first(0.95) >= 6
    assert first(0.95, k_max=3) == 3 and first(k_min=5) == 5


def test_a_cheap_draft_is_trimmed_by_the_acceptance_of_its_own_kind():
    """n-gram drafts from long matches are accepted, from short ones not: trimmed apart."""
    p = AdaptivePolicy(linear_costs(1.0, 0.1))
    s = seq(8)
    p.start(s)
    for _ in range(30):
        p.observe(s, 4, 8, 8)  # key 4: every token accepted
        p.observe(s, 1, 8, 0)  # key 1: none
    cost = linear_costs(1.0, 0.1)

    def verified(key, cheap=True):
        return len(p.select_nodes([s], [Proposal(list(range(8)), None, key)], cost, cheap, 1)[0])

    assert verified(4) == 8
    assert verified(1) == 0
    assert verified(1, cheap=False) == 8  # a costly draft was sized before
    s.k_min = 2
    assert verified(1) == 2  # never under K_min


def tree_proposal(key=4):
    """Two branches at the root: rank 0 (a chain of 3), rank 1 (a chain of 2)."""
    return Proposal([10, 11, 12, 20, 21], None, key, parents=[-1, 0, 1, -1, 3])


def test_the_tree_budget_keeps_the_branches_worth_their_rows_and_shrinks_with_the_batch():
    p = AdaptivePolicy(linear_costs(1.0, 0.05))
    s = seq(8)
    p.start(s)
    for _ in range(30):
        p.observe(s, 4, 3, 1)  # the main chain: about half of its tokens accepted
    for _ in range(200):  # where it was tried, the second branch won half the time
        p.observe_branches([-1, -1], [1])
        p.observe_branches([-1, -1], [])
    cheap_rows = p.select_nodes([s], [tree_proposal()], linear_costs(1.0, 0.05), True, 1)[0]
    assert cheap_rows == [0, 1, 2, 3, 4] or cheap_rows[:4] == [0, 1, 2, 3]  # the branch is in
    dear = p.select_nodes([s], [tree_proposal()], linear_costs(1.0, 0.6), True, 1)[0]
    assert 3 not in dear and len(dear) < len(cheap_rows)  # rows cost more: toward a chain
    none = p.select_nodes([s], [tree_proposal()], lambda rows: float(rows), True, 1)[0]
    assert none == []  # a row costs a whole step: plain decoding
    batch = [seq(8) for _ in range(16)]
    for b in batch:
        p.start(b)
        for _ in range(30):
            p.observe(b, 4, 3, 1)
    chosen = p.select_nodes(batch, [tree_proposal() for _ in batch], linear_costs(1.0, 0.05), True, 16)
    assert sum(map(len, chosen)) < 16 * len(cheap_rows)  # a bigger batch affords fewer nodes each


def test_branch_ranks_learn_which_sibling_wins():
    p = AdaptivePolicy(linear_costs(1.0, 0.05))
    for _ in range(300):
        p.observe_branches([-1, -1, -1], [2])  # the third child always wins: ranks 1 lose, 2 wins
    assert p.branch(1).alpha < 0.05 and p.branch(2).alpha > 0.95
    s = seq(8)
    p.start(s)
    kept = p.select_nodes([s], [Proposal([1, 2, 3], None, 0, [-1, -1, -1])], linear_costs(1.0, 0.01), True, 1)[0]
    assert kept == [0, 2]  # the third child is worth its row, the second (which never wins) is not


def test_k_min_makes_an_adaptive_engine_verify_at_least_k_min_draft_tokens():
    from specfleet_engine.engine import Engine
    from specfleet_engine.proposers import Proposal
    from specfleet_engine.sampling import SamplingParams
    from specfleet_engine.testing import tiny_model

    class Counting:  # a cheap proposer that always has a draft: 1, 2, 3, ...
        name, capabilities = "count", Capabilities(cheap=True)

        def propose(self, seqs, ks):
            return [Proposal(list(range(1, k + 1)), None) for k in ks]

        def rollback(self, seq, num_valid):
            pass

        def release(self, seq):
            pass

    engine = Engine(tiny_model(seed=1, scale=4.0), proposers={"count": Counting()})
    engine.costs.set_curve({r: float(r) for r in range(1, 16)})  # a draft row costs a whole step
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = engine.generate([5, 6, 7, 8], params, "count", 6)
    assert alone.stats.num_draft_tokens == 0, "drafts never pay at this cost: plain decoding"
    s = engine.add([5, 6, 7, 8], params, "count", 6, k_min=2)
    engine.step()  # the prefill
    steps = 0
    while not s.finished:
        room = params.max_tokens - len(s.output) - 1  # drafts never run past max_tokens
        (out,) = engine.step()
        assert out.stats.num_draft_tokens == min(2, room)
        steps += 1
    assert steps > 3
    assert s.output == alone.output


def test_the_latency_guard_keeps_every_sequence_within_max_slowdown_of_plain_decoding():
    """Throughput alone has the step verify rows that slow the requests with nothing to draft;
    with the guard, a request with no draft pays at most max_slowdown more per token."""
    costs = linear_costs(1.0, 0.03)  # each verify row: 3% of a one-row step
    batch = [seq(8) for _ in range(16)]
    proposals = [tree_proposal() if i < 8 else Proposal([], None) for i in range(16)]
    rows = {}
    for guard in (None, 0.05):
        p = AdaptivePolicy(costs, max_slowdown=guard)
        for s in batch:
            p.start(s)
            for _ in range(30):
                p.observe(s, 4, 3, 3)  # drafts well accepted
        rows[guard] = sum(map(len, p.select_nodes(batch, proposals, costs, True, 16)))
    assert costs(16 + rows[None]) > 1.05 * costs(16)  # unguarded: the drafts' rows slow plain requests more
    assert 0 < rows[0.05] < rows[None] and costs(16 + rows[0.05]) <= 1.05 * costs(16)
    # sequences outside this proposer's group (bystanders) count as drafting nothing
    p = AdaptivePolicy(costs, max_slowdown=0.05)
    for s in batch[:8]:
        p.start(s)
        for _ in range(30):
            p.observe(s, 4, 3, 3)
    alone = sum(map(len, p.select_nodes(batch[:8], proposals[:8], lambda r: costs(r + 8), True, 16)))
    assert costs(16 + alone) <= 1.05 * costs(16)


def test_a_probe_survives_the_latency_guard():
    """At K = 0 the ceiling drafts one token every probe_every idle steps so that alpha can
    recover; in a batch of plain requests the guard would prune that row (it slows them all), so
    the probe is a floor until its outcome is observed: alpha recovers, guard or not."""
    costs = linear_costs(1.0, 0.03)  # a verify row: 2% of a 16-row step, over a 1% guard
    p = AdaptivePolicy(costs, max_slowdown=0.01)
    batch = [seq(0) for _ in range(16)]
    for s in batch:
        p.start(s)
    probe = batch[0]
    for _ in range(30):
        p.observe(probe, 1, 4, 0)  # its drafts failed: the ceiling stays at 0
    for _ in range(p.probe_every):
        p.observe(probe, 1, 0, 0)
    assert p.draft_lengths(batch, [8] * 16, costs, True, 16) == [1] + [0] * 15  # the probe is due
    plain = [Proposal([], None) for _ in range(15)]
    assert p.select_nodes(batch, [Proposal([7], None, 4), *plain], costs, True, 16)[0] == [0]
    # the same draft from a sequence that is not probing: the guard prunes it (no guard: kept)
    other = seq(1)
    p.start(other)
    assert p.select_nodes([other, *batch[1:]], [Proposal([7], None, 4), *plain], costs, True, 16)[0] == []
    unguarded = AdaptivePolicy(costs)
    unguarded.start(other)
    assert unguarded.select_nodes([other, *batch[1:]], [Proposal([7], None, 4), *plain], costs, True, 16)[0] == [0]
    before = probe.kstate.window.alpha
    p.observe(probe, 4, 1, 1)  # the probe's token was accepted: alpha moves, the floor goes
    assert probe.kstate.window.alpha > before and p.floor(probe) == 0
    assert p.select_nodes(batch, [Proposal([7], None, 4), *plain], costs, True, 16)[0] == []


def test_a_costly_drafts_probe_is_drafted_whatever_the_budget():
    """A draft model is told how many tokens to draft (choose_ks): a due probe drafts its one."""
    costs = lambda rows: float(rows)  # noqa: E731 - a row costs a whole step: the budget drafts nothing
    p = AdaptivePolicy(costs)
    s = seq(0)
    p.start(s)
    for _ in range(30):
        p.observe(s, 0, 4, 0)
    for _ in range(p.probe_every):
        p.observe(s, 0, 0, 0)
    assert p.draft_lengths([s], [8], costs, False, 1) == [1]
    assert p.draft_lengths([s], [0], costs, False, 1) == [0]  # never past the room left


def test_the_latency_guard_reaches_the_adaptive_policy_by_name():
    costs = linear_costs(1.0, 0.1)
    assert make_policy("adaptive", costs, max_slowdown=0.02).max_slowdown == 0.02
    assert make_policy("adaptive", costs).max_slowdown is None  # absent: off
    assert make_policy("fixed", costs, max_slowdown=0.02).name == "fixed"  # a fixed K has no budget to guard
    with pytest.raises(ValueError, match="max_slowdown must be a fraction >= 0"):
        make_policy("adaptive", costs, max_slowdown=-0.1)


def test_the_latency_guard_keeps_a_bystander_at_plain_decodings_pace_over_its_life():
    """A request with nothing to draft beside one whose drafts are all accepted: each verify row
    (10% of a step here) slows the bystander. Its priced account (`latency_credit`: (1 + guard) x
    plain decoding's step per token it got, less each step's price) never goes below 0 with the
    guard on, and the drafter still drafts as the bystander's credit of 5% a step allows; off, the
    drafter drafts every step and the bystander falls behind plain decoding's pace."""
    from specfleet_engine.engine import NO_SPECULATION, Engine
    from specfleet_engine.sampling import SamplingParams
    from specfleet_engine.testing import tiny_model

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    model = tiny_model(seed=1, scale=4.0)
    truth = Engine(model).generate(prompt, params, NO_SPECULATION, 0).output

    class Oracle:  # a cheap proposer whose drafts are the target's own greedy continuation
        name, capabilities = "oracle", Capabilities(cheap=True)

        def propose(self, seqs, ks):
            return [Proposal(truth[len(s.output):len(s.output) + k], None, 4) for s, k in zip(seqs, ks)]

        def rollback(self, seq, num_valid):
            pass

        def release(self, seq):
            pass

    out = {}
    for guard in (None, 0.05):
        engine = Engine(model, proposers={"oracle": Oracle()}, k_policy="adaptive", max_slowdown=guard)
        engine.costs.set_curve({r: 1.0 + 0.1 * (r - 1) for r in range(1, 64)})
        engine.costs.smoothing, engine.costs.refine_every = 0.0, 0  # prices as set: the account is exact
        drafter = engine.add(prompt, params, "oracle", 4, prior=0.95, batch=2)
        bystander = engine.add([9, 10, 11], params, NO_SPECULATION, 0)
        lowest = 0.0
        while not (drafter.finished and bystander.finished):
            engine.step()
            if not bystander.finished:
                lowest = min(lowest, bystander.latency_credit)
        assert drafter.output == truth
        out[guard] = (lowest, drafter.stats.num_draft_tokens)
    (open_low, open_drafts), (guarded_low, guarded_drafts) = out[None], out[0.05]
    assert open_low < -1.0, out  # unguarded: behind plain decoding's pace by over a step's time
    assert guarded_low >= -1e-9, out
    assert 0 < guarded_drafts < open_drafts, out


def test_a_cheap_drafter_is_not_asked_for_drafts_no_row_can_pay_for():
    """The budget adds the best node first and stops at the first that does not pay: where even
    the best possible node cannot (a verify row costs a whole step), the n-gram drafter is not
    called at all (its search is ~4% of a 16-sequence step); where rows are cheap it is, and a
    k_min floor still drafts whatever the price. Outputs are plain decoding's either way."""
    from specfleet_engine.engine import Engine
    from specfleet_engine.sampling import SamplingParams
    from specfleet_engine.testing import tiny_model

    class Counting:  # a cheap proposer that always has a draft: 1, 2, 3, ...
        name, capabilities = "count", Capabilities(cheap=True)

        def __init__(self):
            self.calls = 0

        def propose(self, seqs, ks):
            self.calls += 1
            return [Proposal(list(range(1, k + 1)), None) for k in ks]

        def rollback(self, seq, num_valid):
            pass

        def release(self, seq):
            pass

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    model = tiny_model(seed=1, scale=4.0)
    plain = Engine(model).generate([5, 6, 7, 8], params, "none", 0).output
    calls = {}
    for name, curve, k_min in (("dear", lambda r: float(r), 0), ("cheap", lambda r: 1.0 + 0.01 * (r - 1), 0),
                               ("floor", lambda r: float(r), 2)):
        drafter = Counting()
        engine = Engine(model, proposers={"count": drafter})
        engine.costs.set_curve({r: curve(r) for r in range(1, 40)})
        assert engine.generate([5, 6, 7, 8], params, "count", 6, k_min=k_min).output == plain
        calls[name] = drafter.calls
    assert calls["dear"] == 0 and calls["cheap"] > 0 and calls["floor"] > 0, calls
