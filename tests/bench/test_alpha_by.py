"""specfleet_bench.alpha_by's counting, on the tests' tiny model: every drafted position lands in
exactly one output bucket and one draft position, and acceptance given the positions before is
what the steps did."""
from __future__ import annotations

from specfleet_bench.alpha_by import run
from specfleet_engine.engine import Engine
from specfleet_engine.testing import repeating_prompts, tiny_model


class Chat:
    """A tokenizer stand-in: the prompts are token ids already."""

    def chat(self, prompt):
        return list(prompt)


def test_acceptance_by_output_and_draft_position_adds_up_to_alpha():
    engine = Engine(tiny_model(seed=1, scale=4.0))
    prompts = [{"turns": [p]} for p in repeating_prompts(6, seed=3)]
    r = run(engine, Chat(), prompts, "ngram", 0.0, 40, bucket=8)
    drafted = sum(r["drafted_by_output_position"].values())
    assert drafted > 0 and r["tokens"] == 6 * 40
    assert sum(r["drafted_by_draft_position"]) == drafted  # each drafted position counted once either way
    starts = [int(k.split("-")[0]) for k in r["drafted_by_output_position"]]  # buckets of 8, those with drafts
    assert starts == sorted(starts) and all(s % 8 == 0 and f"{s}-{s + 7}" in r["drafted_by_output_position"]
                                            for s in starts)
    by_pos = r["drafted_by_draft_position"]
    assert all(a >= b for a, b in zip(by_pos, by_pos[1:]))  # a draft reaching position i+1 reached i
    accepted = sum(round(a * d) for a, d in zip(r["acceptance_by_draft_position"], by_pos) if a is not None)
    assert abs(accepted / drafted - r["alpha"]) < 1e-3
    plain = run(engine, Chat(), prompts, "none", 0.0, 40, bucket=8)
    assert plain["alpha"] is None and plain["tokens"] == 6 * 40
