"""`specfleet up -f deploy/examples/eagle-tree.yaml --demo`: the EAGLE head the worker image
carries, served on SmolLM2-135M through the router, the official openai client as the traffic
(what `./dev run up -f deploy/examples/eagle-tree.yaml --demo` does on a fresh clone)."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from specfleet_local import runfile

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def test_the_eagle_example_serves_the_bundled_head_through_the_openai_client(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("SPECFLEET_REDIS_URL", runfile.ENV)}
    out = subprocess.run(
        [sys.executable, "-m", "specfleet_cli.main", "up", "-f", str(ROOT / "deploy" / "examples" / "eagle-tree.yaml"),
         "--demo", "--exit-after-demo", "--demo-prompts", "4", "--demo-max-tokens", "16", "--http-port", "0",
         "--grpc-port", "0", "--run-file", str(tmp_path / "run" / "up.json")],
        capture_output=True, text=True, env=env, timeout=1400)  # the worker's start has its own bound inside
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-3000:]
    assert "4 of 4 requests answered" in said, said[-3000:]
    rows = re.findall(r"│ (\w+) +│ stable +│ ([\w, ]+?) +│", said)
    methods = {m for _, ms in rows for m in ms.split(", ")}
    # the head drafts; the loop sends 5% of each type's requests to n-gram, the other served method
    assert rows and "eagle" in methods and methods <= {"eagle", "ngram"}, said[-3000:]
    assert "Stopped: router (exit 0), smollm2-eagle-stable-0 (exit 0)" in said, said[-3000:]
