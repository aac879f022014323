import json
import re
import subprocess
import sys

import pytest


def specfleet(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "specfleet_cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_every_subcommand():
    out = specfleet("--help")
    assert out.returncode == 0
    for cmd in ("demo", "generate", "bench", "serve", "operator", "canary"):
        assert cmd in out.stdout


def test_bad_bench_input_exits_2_with_a_message(tmp_path):
    out = specfleet("bench", "--configs", "fp64/ngram")
    assert out.returncode == 2 and "fp64/ngram" in out.stderr
    out = specfleet("bench", "--configs", "fp32/none-corpus")  # a corpus is the n-gram drafter's
    assert out.returncode == 2 and "fp32/none-corpus" in out.stderr
    out = specfleet("bench", "--configs", "fp32/eagle-corpus")
    assert out.returncode == 2 and "fp32/eagle-corpus" in out.stderr
    out = specfleet("bench", "--questions", str(tmp_path / "missing.jsonl"))
    assert out.returncode == 2 and "missing.jsonl" in out.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1}\n')
    out = specfleet("bench", "--questions", str(bad))
    assert out.returncode == 2 and "bad.jsonl:1" in out.stderr


@pytest.mark.slow
def test_bench_runs_end_to_end_on_smollm2(tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) for i, (c, t) in enumerate([
        ("extraction", "Extract the year from: 'The bridge opened in 1932 and closed in 1990.'"),
        ("qa", "What is the capital of France?"),
    ])) + "\n")
    out_json = tmp_path / "r.json"
    # -k 2: drafts of a fixed length (the adaptive policy, priced on a loaded machine, may draft none)
    out = specfleet("bench", "--questions", str(q), "--max-tokens", "6", "-k", "2", "--configs",
                    "fp32/ngram,fp32/ngram-tree,fp32/ngram-corpus,fp32/eagle-tree,int8/ngram", "--out", str(out_json),
                    "--plot", str(tmp_path / "r.png"))
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out_json.read_text())
    assert r["questions"] == 2 and set(r["configs"]) == {"fp32/none", "fp32/ngram", "fp32/ngram-tree", "fp32/ngram-corpus",
                                                         "fp32/eagle-tree", "int8/ngram"}
    # int8 has no plain twin here; the EAGLE config drafts with the bundled head
    assert r["spec_equals_plain"] == {"fp32/ngram": 2, "fp32/ngram-tree": 2, "fp32/ngram-corpus": 2,
                                      "fp32/eagle-tree": 2}
    assert r["table"]["overall"]["fp32/eagle-tree"]["alpha"] is not None
    assert r["trees_vs_chains"]["fp32"]["categories"] == 2
    assert r["table"]["overall"]["fp32/none"]["tokens"] > 0
    assert (tmp_path / "r.png").stat().st_size > 0 and out_json.with_suffix(".md").exists()


def test_generate_and_bench_with_medusa_need_the_heads_folder_and_name_a_missing_one(tmp_path):
    """Medusa heads are trained per model (no bundled ones): --method medusa (a medusa bench
    config) without --medusa-heads, or with a folder that is not there, exits 2 saying which,
    before any model loads."""
    out = specfleet("generate", "Hi", "--method", "medusa")
    assert out.returncode == 2 and "--method medusa needs --medusa-heads FOLDER" in out.stderr
    out = specfleet("generate", "Hi", "--method", "medusa", "--medusa-heads", str(tmp_path / "nowhere"))
    assert out.returncode == 2 and f"--medusa-heads {tmp_path / 'nowhere'}: no such folder" in out.stderr
    out = specfleet("bench", "--configs", "fp32/medusa-tree")
    assert out.returncode == 2 and "medusa configs need --medusa-heads FOLDER" in out.stderr


@pytest.mark.slow
def test_generate_drafts_with_the_bundled_eagle_head_and_names_a_missing_one():
    out = specfleet("generate", "Write a short story about a robot.", "--method", "eagle", "--max-tokens", "24",
                    "--threads", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "method eagle" in out.stderr and out.stdout.strip()
    out = specfleet("generate", "Hi", "--method", "eagle", "--draft-head", "/nonexistent", "--max-tokens", "4")
    assert out.returncode == 2 and "/nonexistent" in out.stderr and "config.json is missing" in out.stderr


def test_generate_mixes_ngram_chains_into_the_heads_tree_and_refuses_a_method_without_one():
    out = specfleet("generate", "Repeat exactly: the cat sat on the mat, the cat sat on the mat.", "--method", "eagle",
                    "--ngram-mix", "--max-tokens", "24", "--threads", "1", "--temperature", "0")
    assert out.returncode == 0, out.stderr[-2000:]
    share = re.search(r"n-gram share (\d+)%", out.stderr)
    assert share and int(share.group(1)) > 0, out.stderr[-500:]  # the chain was drafted and accepted
    out = specfleet("generate", "Hi", "--method", "ngram", "--ngram-mix")
    assert out.returncode == 2 and "--ngram-mix" in out.stderr and "--method ngram has none" in out.stderr
