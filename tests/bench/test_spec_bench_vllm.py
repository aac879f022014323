"""`specfleet bench --configs vllm/none,vllm/ngram` without vLLM: the configs it reads, an answer
read as a run of ours (a captured vLLM answer's metrics), the agreement with fp32/none and the
table's rows, the request sent (to a stand-in HTTP server on loopback), the server's flags, and
the error a missing vLLM venv gives."""

import doctest
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specfleet_bench import spec_bench_vllm
from specfleet_bench.spec_bench import Run, agreement_with_baseline, markdown_table, parse_configs, summarize
from specfleet_bench.spec_bench_vllm import VllmConfig, read_answer

CAPTURED = Path(__file__).parents[1] / "vllm" / "data"
EOS = (2, 0)


def test_the_doctests():
    assert doctest.testmod(spec_bench_vllm).failed == 0


def test_vllm_configs_are_read_and_fp32_plain_is_added_to_compare_with():
    assert parse_configs("vllm/ngram,fp32/ngram,vllm/none") == [("fp32", "none"), ("vllm", "ngram"), ("fp32", "ngram"),
                                                                ("vllm", "none")]


@pytest.mark.parametrize("item", ["vllm/eagle", "vllm/ngram-tree", "vllm/plain", "vllm/ngram+ngram"])
def test_a_vllm_method_other_than_none_or_ngram_is_refused_naming_the_item(item):
    with pytest.raises(ValueError, match=re.escape(f"--configs: {item!r} is not PRECISION/METHOD")) as e:
        parse_configs(item)
    assert "vllm/none|vllm/ngram" in str(e.value)


def test_a_k_policy_on_a_vllm_config_is_refused():
    with pytest.raises(ValueError, match="@KPOLICY must be one of"):
        parse_configs("vllm/ngram@fixed")


def captured(name: str, token_ids: list[int]) -> dict:
    """A captured answer's body (its usage and metrics as vLLM sent them) with the token ids a
    request with return_token_ids gets."""
    body = json.loads((CAPTURED / name).read_text())["response"]
    body["choices"][0]["token_ids"] = token_ids
    return body


def test_a_speculating_answer_is_counted_from_its_metrics():
    """Captured n-gram answer: 128 tokens, 24 accepted of 224 drafted: 127 - 24 = 103 decoding steps
    after the prefill's; the trailing end-of-sequence id is left out as our engine leaves it out."""
    ids = list(range(10, 137)) + [2]
    out, steps, drafted, accepted, server_s = read_answer(captured("ngram/chat-q82.json", ids), EOS, speculating=True)
    assert out == ids[:-1]
    assert (steps, drafted, accepted) == (104, 224, 24)
    assert server_s == pytest.approx((135.15547299994068 + 5170.043245000215) / 1000)


def test_a_plain_answer_is_one_step_a_token():
    ids = list(range(10, 138))
    out, steps, drafted, accepted, _ = read_answer(captured("plain/chat-q82.json", ids), EOS, speculating=False)
    assert out == ids and (steps, drafted, accepted) == (128, 0, 0)


def test_an_answer_without_what_the_bench_reads_is_refused_naming_the_field():
    body = captured("ngram/chat-q82.json", [5, 6])
    with pytest.raises(ValueError, match=re.escape("choices[0].token_ids")):
        read_answer({**body, "choices": [{"text": "hi"}]}, EOS, speculating=True)
    plain = captured("plain/chat-q82.json", [5, 6])
    with pytest.raises(ValueError, match="metrics.speculative_decoding: missing"):
        read_answer(plain, EOS, speculating=True)
    with pytest.raises(ValueError, match="enable-per-request-metrics"):
        read_answer({**plain, "metrics": None}, EOS, speculating=False)


def runs_of(config: str, outputs: dict[int, list[int]], seconds: float, steps=None, drafted=0, accepted=0):
    return [Run(config, "qa" if q % 2 else "math", q, len(out), seconds, steps or len(out), drafted, accepted, out)
            for q, out in outputs.items()]


def test_agreement_and_rows_beside_ours():
    base = {1: [5, 6, 7, 8], 2: [5, 6, 7, 8]}
    runs = (runs_of("fp32/none", base, 1.0) + runs_of("vllm/none", {1: [5, 6, 7, 8], 2: [5, 6, 9, 8]}, 2.0)
            + runs_of("vllm/ngram", {1: [5, 6, 7, 8], 2: [5, 6, 7]}, 1.0, steps=2, drafted=6, accepted=3))
    assert agreement_with_baseline(runs, "vllm/none") == {"equal": 1, "questions": 2, "first_difference": {2: 2}}
    assert agreement_with_baseline(runs, "vllm/ngram") == {"equal": 1, "questions": 2, "first_difference": {2: 3}}
    configs = parse_configs("vllm/none,vllm/ngram")
    table = summarize(runs, configs)
    plain, ngram = table["overall"]["vllm/none"], table["overall"]["vllm/ngram"]
    assert (plain["tok_s"], plain["speedup_vs_fp32_plain"], plain["equal_to_fp32_plain"], plain["questions"]) == (
        2.0, 0.5, 1, 2)
    assert (ngram["tau"], ngram["alpha"], ngram["speedup_vs_same_precision_plain"]) == (1.75, 0.5, 1.75)
    assert (table["qa"]["vllm/none"]["equal_to_fp32_plain"], table["math"]["vllm/none"]["equal_to_fp32_plain"]) == (1, 0)
    assert "equal_to_fp32_plain" not in table["overall"]["fp32/none"]
    md = markdown_table(table, [f"{p}/{m}" for p, m in configs])
    assert "| **overall** | 4.0 (1.00x) | 2.0 (0.50x) =1/2 | 3.5 (0.88x) τ1.75 α0.50 =1/2 |" in md


@pytest.fixture
def fake_venv(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    monkeypatch.setenv("SPECFLEET_VLLM_VENV", str(venv))
    return venv


def test_the_server_runs_ours_k_on_our_threads_cores_with_per_request_metrics(fake_venv, tmp_path):
    from specfleet_api import vllm as vllm_api

    vc = VllmConfig(tmp_path / "model", "ngram", 5, 1, EOS, 16, "smollm2-135m")
    argv = vc.server.argv()
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 5
    for flags in (vllm_api.SPEC_METRICS, vllm_api.TIMING_METRICS):
        i = argv.index(flags[0])
        assert tuple(argv[i:i + len(flags)]) == flags
    env = vc.server.env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == vc.cpus == spec_bench_vllm.cpu_set(1)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    plain = VllmConfig(tmp_path / "model", "none", 5, 1, EOS, 16, "m")
    assert "--speculative-config" not in plain.server.argv() and vllm_api.TIMING_METRICS[0] in plain.server.argv()


def test_a_question_is_sent_as_our_prompt_ids_and_timed_here(fake_venv, tmp_path):
    """VllmConfig.run against a stand-in server on loopback: the request is greedy on our token
    ids and asks for the output's ids; the answer comes back as Runner.run returns ours."""
    seen = []
    body = captured("ngram/chat-q82.json", list(range(10, 137)) + [2])

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            seen.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            raw = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        vc = VllmConfig(tmp_path / "model", "ngram", 4, 1, EOS, 128, "smollm2-135m")
        vc.server.port = httpd.server_address[1]
        out, dt, steps, drafted, accepted, ngram = vc.run([1, 9, 1400])
    finally:
        httpd.shutdown()
        thread.join(timeout=10)
    assert seen == [("/v1/completions", {"model": "smollm2-135m", "prompt": [1, 9, 1400], "max_tokens": 128,
                                         "temperature": 0, "return_token_ids": True})]
    assert out == list(range(10, 137)) and dt > 0 and (steps, drafted, accepted, ngram) == (104, 224, 24, 0)
    assert vc.server_seconds == pytest.approx(5.305, abs=1e-3)


def test_without_the_vllm_venv_the_bench_names_the_set_up_step_and_exits_2(tmp_path, monkeypatch, capsys):
    """Before any model loads (this test loads none)."""
    from specfleet_cli.main import main

    monkeypatch.setenv("SPECFLEET_VLLM_VENV", str(tmp_path / "absent"))
    assert main(["bench", "--configs", "vllm/none", "--out", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert "./dev setup --vllm" in err and str(tmp_path / "absent") in err
