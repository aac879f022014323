"""specfleet_bench.oracle_replay: recorded outputs replayed through the engine with an oracle model."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "docs" / "bench" / "smollm2-dev-greedy-outputs.jsonl"


@pytest.fixture(scope="module")
def replay_mod():
    from specfleet_bench import oracle_replay

    return oracle_replay


def records(category, n):
    rows = [json.loads(line) for line in RECORDED.read_text().splitlines()]
    return [r for r in rows if r["category"] == category][:n]


def test_replay_reproduces_the_recording_and_counts_steps(replay_mod):
    recs = records("extraction", 2) + records("writing", 1)
    flat = {i + 1: 1.0 + 0.03 * i for i in range(12)}
    res = replay_mod.replay(recs, flat)  # raises if the engine's output diverged from the recording
    n, spec, plain, steps = res["extraction"]
    assert n == sum(len(r["output"]) - 1 for r in recs[:2])  # both ran to max_tokens
    assert n / steps > 1.5, "extraction copies its prompt: drafts must be accepted"
    assert plain / spec > 1.3
    # drafts that cost as much as the tokens they could yield are not verified: plain decoding,
    # but for the K policy's probes (one draft token every probe_every idle steps, so alpha can recover)
    costly = {i + 1: float(i + 1) for i in range(12)}
    n, spec, plain, steps = replay_mod.replay(recs, costly)["extraction"]
    probes = n // 32 + 2
    assert n - probes <= steps <= n and plain <= spec <= plain + probes


def test_replay_cli_names_a_missing_file(replay_mod, capsys):
    with pytest.raises(SystemExit) as e:
        replay_mod.main(["replay", "/nonexistent/outputs.jsonl"])
    assert e.value.code == 2 and "no such file" in capsys.readouterr().err


def test_recycled_trees_replay_with_the_models_own_top_choices(replay_mod):
    """`budgets --recycle`: the model's top choices at every position (its first must be the
    recording's next token, else model_top raises), replayed as the oracle's ranked logits."""
    recs = records("writing", 2)
    tops = replay_mod.model_top(recs, 3)
    assert [t.shape for t in tops] == [(len(r["prompt"]) + len(r["output"]), 3) for r in recs]
    row = replay_mod.budgets(recs, [16], branching=4, k=8, max_tokens=128, tops=tops)[16]
    assert list(row) == ["chain", "tree", "recycled tree"]
    assert row["recycled tree"]["overall"] > row["tree"]["overall"] >= row["chain"]["overall"], row
