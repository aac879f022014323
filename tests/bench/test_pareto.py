"""`specfleet bench pareto` end to end on the tests' tiny model: every point of a small grid served by
a real gRPC worker, the front marked, greedy speculation equal to plain decoding, bad grids refused."""
from __future__ import annotations

import doctest
import json

import pytest

from specfleet_bench import pareto
from specfleet_cli.main import main as cli


def test_docstring_examples():
    assert doctest.testmod(pareto).failed == 0


def test_a_small_sweep_writes_every_point_its_front_and_the_plot(tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    assert cli(["bench", "pareto", "--model", "tiny-random", "--draft", "ngram", "--precisions", "none",
                "--methods", "none,ngram", "--trees", "1,2", "--concurrency", "1,2", "--temperatures", "0,0.8",
                "--limit", "4", "--max-tokens", "12", "--threads", "1", "--out", str(out), "--plot", str(png)]) == 0
    r = json.loads(out.read_text())
    grid = {(p["method"], p["tree"], p["concurrency"], p["temperature"]) for p in r["points"]}
    # plain decoding has no tree: one point per concurrency and temperature; n-gram two trees
    assert grid == {(m, t, c, temp) for m, t in (("none", 0), ("ngram", 1), ("ngram", 2))
                    for c in (1, 2) for temp in (0.0, 0.8)}
    for p in r["points"]:
        assert p["requests"] == 4 and not p["errors"] and p["tokens"] > 0
        assert p["tokens_per_s"] > 0 and 0 < p["ttft_p50_s"] and 0 < p["tpot_p50_s"] <= p["tpot_p99_s"]
        assert p["dollars_per_million"] == pytest.approx(1e6 / (p["tokens_per_s"] * 3600), rel=1e-2)
        if p["temperature"] == 0.0:
            assert p["equals_plain"] is True  # lossless: greedy speculation is plain decoding's output
    front = r["front"]
    assert front and all(p["on_front"] for p in front)
    for p in r["points"]:  # nothing on the front is beaten on both axes by any point
        if p["on_front"]:
            assert not any(q["tokens_per_s"] > p["tokens_per_s"] and q["tpot_p50_s"] < p["tpot_p50_s"]
                           for q in r["points"])
    assert png.stat().st_size > 10_000
    assert "tokens_per_s" in capsys.readouterr().out


@pytest.mark.parametrize("flag,value,says", [
    ("--methods", "none,eagle", "'eagle' is not served"),
    ("--precisions", "fp8", "'fp8' is not one of"),
    ("--k-policies", "greedy", "'greedy' is not one of"),
])
def test_a_grid_the_workers_cannot_serve_is_refused_naming_it(flag, value, says, capsys):
    with pytest.raises(SystemExit) as e:
        cli(["bench", "pareto", "--model", "tiny-random", "--draft", "ngram", "--methods", "none,ngram", flag, value])
    assert e.value.code == 2 and says in capsys.readouterr().err
