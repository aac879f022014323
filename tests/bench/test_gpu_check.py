"""bench/gpu_check.sh in its CPU smoke mode (tiny shapes, kernels under TRITON_INTERPRET=1): every part
runs and reports, so the GPU check cannot rot between runs on a GPU machine."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "OUT": str(out)}
    env.pop("SPECFLEET_KERNELS", None)
    proc = subprocess.run([str(ROOT / "bench" / "gpu_check.sh"), "--cpu-smoke"], env=env, capture_output=True,
                          text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu-check-cpu-smoke.json").read_text()), (out / "gpu-check-cpu-smoke.txt").read_text()


def test_every_part_ran(smoke):
    res, text = smoke
    assert res["mode"] == "cpu-smoke" and res["pytest"]["status"] == "skipped"
    for name in ("tree_attention", "rejection", "decode"):
        assert "status" not in res[name] or res[name]["status"].startswith("skipped"), res[name]
    assert "(b) tree attention" in text and "(d) speculative decoding" in text


def test_tree_attention_rows_cover_the_grid_and_agree(smoke):
    rows = smoke[0]["tree_attention"]["rows"]
    assert {(r["batch"], r["prefix"], r["tree"]) for r in rows} == {(b, p, n) for b in (1, 2) for p in (40, 300)
                                                                     for n in (3, 8)}
    for r in rows:
        assert r["max_err_vs_ref"] < 1e-4 and r["max_err_vs_sdpa"] < 1e-4, r  # all three compute the same
        assert r["triton_ms"] > 0 and r["ref_ms"] > 0 and r["sdpa_ms"] > 0 and r["gbs"] > 0


def test_speculative_smoke_equals_plain_decoding(smoke):
    rows = smoke[0]["decode"]["rows"]
    assert [(r["seqs"], r["graphs"]) for r in rows] == [(1, False), (2, False), (1, True), (2, True)]
    for r in rows:
        assert r["equal"] and r["drafted"] > 0 and r["plain_tok_s"] > 0 and r["ngram_tok_s"] > 0, r
        # the graphed runs took the padded step (eagerly, on the CPU) and gave the ungraphed tokens
        assert (r["graph_stats"] or {}).get("replays", 0) > 0 if r["graphs"] else r["graph_stats"] is None
