"""vLLM's CPU build as Spec-Bench configurations (`specfleet bench --configs vllm/none,vllm/ngram`),
so that vLLM decodes the same questions beside our engine and lands in the same table.

The same work as our configurations: the question's first turn through our tokenizer's chat
template, sent as token ids (/v1/completions with `prompt` a list of ids, so both engines decode
from identical input, whatever the server's own template would render); greedy (temperature 0);
the same --max-tokens; the same stop tokens (the export's generation_config names every
end-of-sequence id our engine stops on). The same threads: the server's model threads bind the
first N cores this process may run on (`VllmServer(cpus=...)`: VLLM_CPU_OMP_THREADS_BIND, none
reserved), N being the torch thread count our configurations run with. The same K: vllm/ngram
drafts the K our n-gram configurations are given (`Runner.k_of`: -k, else the engine's default),
at every step; without -k ours adapts K under that bound, vLLM's stays fixed.

Timing, as our configurations time `engine.generate`: the wall seconds on this side from sending
the request to having read its whole answer. Included: the prefill and the decode, and what
serving adds to each request: the HTTP round trip over loopback, the API server's validation and
scheduling, the output's detokenization (vLLM writes the text too), the JSON answer; on a machine
with no spare core, the API server and this client share the cores the model threads bind. Not
included: the server's start (compiling the model; printed, and kept in the results), one warm-up
request, the chat template (applied once, for both engines). Each answer's own timings (scheduling
to last token, from its `metrics`) are summed beside, so that overhead can be read off.

tau and alpha come from each answer's metrics.speculative_decoding (the server runs with
--per-request-spec-decode-metrics summary and --enable-per-request-metrics), read by the router's
`vllm_evidence.parse` and counted as the fleet counts a vLLM pool's answers (`vllm_evidence.counts`).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path

from specfleet_local.vllm import VllmError, VllmServer, ngram_config, vllm_python
from specfleet_router.vllm_evidence import counts, parse

REQUEST_TIMEOUT_S = 600.0  # one answer of at most --max-tokens tokens; far above any measured


def require_venv() -> Path:
    """vLLM's venv python, or a ValueError naming the set-up step (the CLI prints it, exits 2)."""
    try:
        return vllm_python()
    except VllmError as e:
        raise ValueError(f"--configs vllm/...: {e}") from None


def cpu_set(n: int, allowed: Iterable[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `n` model threads: the first n CPUs of `allowed` (default:
    those this process may run on), as ranges.

    >>> cpu_set(2, {0, 1, 2, 3}), cpu_set(3, {8, 2, 3, 5}), cpu_set(1, {4})
    ('0-1', '2-3,5', '4')
    """
    import os

    cpus = sorted(os.sched_getaffinity(0) if allowed is None else allowed)[:n]
    if n < 1 or len(cpus) < n:
        raise ValueError(f"--threads {n}: vLLM binds one CPU a thread, and this process may run on {len(cpus)}")
    ranges: list[list[int]] = []
    for c in cpus:
        if ranges and c == ranges[-1][1] + 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def completion_request(model: str, prompt: list[int], max_tokens: int) -> dict:
    """A greedy /v1/completions request on token ids that returns the output's ids.

    >>> completion_request("m", [1, 2], 8)
    {'model': 'm', 'prompt': [1, 2], 'max_tokens': 8, 'temperature': 0, 'return_token_ids': True}
    """
    return {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}


def read_answer(body: dict, eos_ids: Iterable[int], speculating: bool) -> tuple[list[int], int, int, int, float]:
    """One /v1/completions answer as the bench counts a run of ours: (output ids less trailing
    end-of-sequence ids, which our engine leaves out of its output; target forwards, the prefill's
    included as ours are; draft tokens; accepted draft tokens; the server's own seconds, scheduling
    to last token). ValueError naming the field when the answer lacks what the bench reads.

    >>> body = {"choices": [{"token_ids": [5, 6, 7, 8, 9, 2]}], "usage": {"completion_tokens": 6},
    ...         "metrics": {"time_to_first_token_ms": 25.0, "generation_time_ms": 50.0,
    ...                     "speculative_decoding": {"acceptance_histogram": [1, 0, 1], "num_draft_tokens": 4,
    ...                                              "num_accepted_draft_tokens": 2}}}
    >>> out, steps, drafted, accepted, seconds = read_answer(body, {0, 2}, speculating=True)
    >>> out, steps, drafted, accepted, round(seconds, 3)  # 5 tokens after the prefill's: 3 steps, 2 accepted
    ([5, 6, 7, 8, 9], 4, 4, 2, 0.075)
    """
    choices = body.get("choices") or [{}]
    ids = choices[0].get("token_ids")
    if not isinstance(ids, list):
        raise ValueError("choices[0].token_ids: missing (the request asks for return_token_ids)")
    answer = parse(body)
    if speculating and answer.spec is None:
        raise ValueError("metrics.speculative_decoding: missing from a speculating server's answer (it runs "
                         "without --per-request-spec-decode-metrics)")
    if answer.decode_s is None or answer.ttft_s is None:
        raise ValueError("metrics.generation_time_ms: missing (the server runs without --enable-per-request-metrics)")
    eos = set(eos_ids)
    out = list(ids)
    while out and out[-1] in eos:
        out.pop()
    c = counts(answer, speculating=speculating, plain_itl_s=None)
    return out, c.steps + 1, c.draft_tokens, c.accepted_tokens, answer.ttft_s + answer.decode_s


class VllmConfig:
    """One vllm/METHOD configuration: its server, started once for all questions, and one
    question's run timed as ours are (`run` returns what `Runner.run` returns)."""

    def __init__(self, model_dir: Path, method: str, k: int, threads: int, eos_ids: Iterable[int],
                 max_tokens: int, served_model_name: str, log: Path | None = None):
        self.method, self.k, self.max_tokens, self.eos = method, k, max_tokens, set(eos_ids)
        self.speculating = method != "none"
        self.cpus = cpu_set(threads)
        self.server = VllmServer(model_dir, ngram_config(k) if self.speculating else None, cpus=self.cpus,
                                 served_model_name=served_model_name, log=log)
        self.server_seconds = 0.0

    def start(self, progress: Callable[[str], None] = print) -> float:
        """Starts the server and waits for it (stopping it if the wait fails); its start-up seconds."""
        self.server.start()
        try:
            return self.server.wait_ready(progress=progress)
        except BaseException:
            self.server.stop()
            raise

    def stop(self) -> None:
        self.server.stop()

    def run(self, prompt: list[int]) -> tuple[list[int], float, int, int, int, int]:
        data = json.dumps(completion_request(self.server.served_model_name, prompt, self.max_tokens)).encode()
        req = urllib.request.Request(f"{self.server.base_url}/completions", data, {"Content-Type": "application/json"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            raw = r.read()
        dt = time.perf_counter() - t
        out, steps, drafted, accepted, server_s = read_answer(json.loads(raw), self.eos, self.speculating)
        self.server_seconds += server_s
        return out, dt, steps, drafted, accepted, 0

    def summary(self) -> dict:
        """What the results keep of the server: its start, K, cores and arguments."""
        return {"ready_after_s": round(self.server.ready_after_s or 0.0, 1), "k": self.k if self.speculating else None,
                "cpus": self.cpus, "argv": self.server.argv()[1:]}
