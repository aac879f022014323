"""What the vLLM tests share: the bundled model exported once a session, specfleet's own greedy
answers to compare with, the Spec-Bench prompts, and what an answer's `metrics` must satisfy
(`check_spec_metrics`), the live server's and the captured ones alike (tests/vllm/data).

The tests marked `vllm` start real vLLM servers (`./dev setup --vllm` first, then
`./dev test -m vllm`); the rest read files only and run in the default suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
MODEL_NAME = "smollm2-135m-instruct"  # the served model name the servers and the fixtures use


def check_spec_metrics(metrics: dict, completion_tokens: int, k: int) -> dict:
    """Fails unless one answer's metrics.speculative_decoding (vLLM's `summary` level) is present
    and consistent with itself and with the answer's length on a server drafting `k` tokens a step;
    returns it. A verify step accepts j of at most k draft tokens and emits j + 1 tokens; the first
    output token comes from the prefill, so the verify steps and their accepted tokens add up to at
    most completion_tokens - 1 (steps without a draft are plain decoding steps)."""
    spec = metrics.get("speculative_decoding")
    assert isinstance(spec, dict), f"no metrics.speculative_decoding in {metrics}"
    hist = spec["acceptance_histogram"]
    steps, accepted, drafted = spec["num_spec_steps"], spec["num_accepted_draft_tokens"], spec["num_draft_tokens"]
    assert spec["num_spec_tokens"] == k and len(hist) == k + 1, spec
    assert all(isinstance(h, int) and h >= 0 for h in hist), spec
    assert sum(hist) == steps, f"the histogram sums to {sum(hist)}, not to the {steps} verify steps: {spec}"
    assert sum(j * h for j, h in enumerate(hist)) == accepted, spec
    assert 0 <= accepted <= drafted <= k * steps, spec
    assert steps + accepted <= completion_tokens - 1, (completion_tokens, spec)
    if steps:
        assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / steps, rel=1e-12), spec
    if drafted:
        assert spec["draft_acceptance_rate"] == pytest.approx(accepted / drafted, rel=1e-12), spec
    return spec


def check_timing_metrics(metrics: dict, completion_tokens: int) -> None:
    """The per-request timings `--enable-per-request-metrics` adds: milliseconds, consistent."""
    for key in ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"):
        assert isinstance(metrics.get(key), (int, float)) and metrics[key] >= 0, (key, metrics)
    assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / (completion_tokens - 1), rel=1e-9)


@pytest.fixture
def spec_metrics():
    return check_spec_metrics


@pytest.fixture
def timing_metrics():
    return check_timing_metrics


@pytest.fixture
def same_greedy(ours):
    """assert_same_greedy with our engine at hand: (prompt, ours, theirs, who) -> a near-tie's note."""
    return lambda prompt, mine, theirs, who: assert_same_greedy(ours, prompt, mine, theirs, who)


#: vLLM's start (torch.compile of the model at every start: its compile cache fails to load on the
#: CPU) took 75-150 s on a 2-core machine, 200 s beside a whole test run; the wait fails sooner
#: when the server's processes stop using the CPU (`stall_s`). 1800 s bounds a machine 4x slower
#: under that load; the vllm tests' pytest timeout leaves room for it and their requests.
SERVER_START_S, SERVER_STALL_S = 1800, 300
VLLM_TEST_TIMEOUT_S = SERVER_START_S + 600


def pytest_collection_modifyitems(config, items):
    """A `vllm` test's timeout covers a server's start (its module's first test pays it)."""
    for item in items:
        if item.get_closest_marker("vllm") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(VLLM_TEST_TIMEOUT_S))


@pytest.fixture(scope="module")
def start_vllm(export_dir, tmp_path_factory):
    """Starts a vLLM server on the export (speculative: its --speculative-config, None: plain) and
    waits until it is ready; every server started is stopped when the module ends."""
    from specfleet_local.vllm import VllmServer

    started = []

    def start(speculative: dict | None = None) -> VllmServer:
        log = tmp_path_factory.mktemp("vllm") / "server.log"
        server = VllmServer(export_dir, speculative, served_model_name=MODEL_NAME, log=log).start()
        started.append(server)
        server.wait_ready(timeout_s=SERVER_START_S, stall_s=SERVER_STALL_S)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory) -> Path:
    """The bundled model as a HF folder, written by `specfleet export-hf`'s code."""
    from specfleet_engine.hf_export import export_hf

    return export_hf("smollm2-135m", tmp_path_factory.mktemp("export") / MODEL_NAME, progress=lambda _: None)


@pytest.fixture(scope="session")
def prompts() -> list[dict]:
    """Three Spec-Bench first turns, each from another category."""
    from specfleet_bench.questions import default_questions, pick_prompts

    return pick_prompts(default_questions(), 3)


@pytest.fixture(scope="session")
def ours():
    """specfleet's engine on the bundled model in float32 (what `specfleet generate` runs), and a
    function of (user prompt, max_tokens) to its greedy (prompt ids, output ids), ignoring eos."""
    import torch

    from specfleet_engine.engine import Engine
    from specfleet_engine.factory import build_engine_parts
    from specfleet_engine.sampling import SamplingParams

    torch.set_num_threads(2)
    model, tokenizer, proposers = build_engine_parts("smollm2-135m", "fp32")
    engine = Engine(model, tokenizer, proposers=proposers)

    def greedy(prompt: str, max_tokens: int) -> tuple[list[int], list[int]]:
        ids = tokenizer.chat(prompt)
        return ids, engine.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), "none").output

    def next_logits(ids: list[int]) -> torch.Tensor:
        """Our logits for the token after `ids` [V]."""
        seq = engine.add(ids, SamplingParams(max_tokens=1), "none")
        try:
            return engine._forward([seq], [ids], "last")[-1].float()
        finally:
            engine.abort(seq)

    greedy.tokenizer, greedy.next_logits = tokenizer, next_logits
    return greedy


#: How far apart two logits may be for greedy decoding on two engines to pick either: float32
#: rounding in another order of operations (vLLM's kernels, HF's) moves SmolLM2's logits by 1e-4 at
#: most (test_smollm2); a gap ten times that is a model that differs.
NEAR_TIE = 1e-3


def assert_same_greedy(ours, prompt: list[int], mine: list[int], theirs: list[int], who: str) -> str | None:
    """Fails unless `theirs` is our greedy output `mine` up to where it took the other side of a
    near-tie (our logits of the two tokens within NEAR_TIE; past it the two continue different
    texts); returns a note on that near-tie, None when the two are equal."""
    assert len(theirs) == len(mine), (len(theirs), len(mine))
    first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
    if first is None:
        return None
    logits = ours.next_logits(prompt + mine[:first])
    gap = float(logits[mine[first]] - logits[theirs[first]])
    assert gap < NEAR_TIE, (f"token {first}: ours {mine[first]}, {who}'s {theirs[first]}, our logit of ours "
                            f"{gap:.1e} higher: not a near-tie\n ours   {mine[:first + 1]}\n {who} {theirs[:first + 1]}")
    return f"token {first}: {who} took {theirs[first]} for our {mine[first]}, {gap:.1e} apart in our logits"
