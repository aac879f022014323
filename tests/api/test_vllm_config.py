"""The spec -> vLLM mapping (specfleet_api.vllm): which pools each arm runs, each server's flags and
--speculative-config, the flags the operator owns, and what vLLM cannot serve; torch-free."""
from __future__ import annotations

import doctest
import inspect
import json

import pytest

from specfleet_api import fleet_spec as fs
from specfleet_api import vllm

BASE = {"engine": {"name": "vllm"}, "model": {"name": "llama", "uri": "/models/llama"}, "replicas": 3,
        "draft": {"method": "ngram"}, "routing": {},
        "speculation": {"kMin": 0, "kInitial": 5, "kMax": 5, "kPolicy": "fixed", "tree": {"branching": 1, "depth": 0}},
        "quantization": "none", "dtype": "auto", "device": "auto"}
#: The keys of vLLM's SpeculativeConfig (vllm/config/speculative.py, v0.32) this mapping writes, and the
#: values of its `method` it names: a typo here would fail a server at start, not a test.
VLLM_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
VLLM_METHODS = {"ngram", "draft_model", "eagle", "eagle3", "medusa"}


def spec(**over):
    return {**BASE, **over}


def test_docstring_examples():
    assert doctest.testmod(vllm).failed == 0


@pytest.mark.parametrize("method, uri, want", [
    ("ngram", None, {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 4}),
    ("draft-model", "/models/small", {"method": "draft_model", "model": "/models/small", "num_speculative_tokens": 5}),
    ("eagle", "file:///heads/e", {"method": "eagle", "model": "/heads/e", "num_speculative_tokens": 5}),
    ("medusa", "/heads/m", {"method": "medusa", "model": "/heads/m", "num_speculative_tokens": 5}),
])
def test_each_method_maps_onto_vllms_speculative_config_with_k_as_kmax(method, uri, want):
    arm = spec(draft={"method": method, **({"uri": uri} if uri else {})})
    got = vllm.speculative_config(arm, method)
    assert got == want and set(got) <= VLLM_KEYS and got["method"] in VLLM_METHODS
    assert vllm.speculative_config(arm, "none") is None  # the plain pool speculates not at all


def test_an_eagle3_head_and_other_lookup_lengths_come_from_engine_vllm():
    s = spec(draft={"method": "eagle", "uri": "/heads/e3"},
             engine={"name": "vllm", "vllm": {"eagleMethod": "eagle3", "ngram": {"promptLookupMin": 2,
                                                                                 "promptLookupMax": 6}}})
    args = {m: vllm.server_args(s, s, m, gpus=True) for m in ("ngram", "eagle")}
    configs = {m: json.loads(a[a.index("--speculative-config") + 1]) for m, a in args.items()}
    assert configs["eagle"]["method"] == "eagle3" and configs["eagle"]["model"] == "/heads/e3"
    assert (configs["ngram"]["prompt_lookup_min"], configs["ngram"]["prompt_lookup_max"]) == (2, 6)


def test_the_default_lookup_is_specfleets_own_ngram_lengths():
    """draft.method ngram looks up the same n-grams on either engine unless engine.vllm.ngram says otherwise."""
    from specfleet_engine.proposers.ngram import NgramProposer

    params = inspect.signature(NgramProposer).parameters
    assert (params["min_n"].default, params["max_n"].default) == (vllm.PROMPT_LOOKUP_MIN, vllm.PROMPT_LOOKUP_MAX)


def test_server_args_are_the_operators_flags_then_the_users():
    s = spec(engine={"name": "vllm", "vllm": {"args": ["--max-model-len", "8192"]}})
    args = vllm.server_args(s, s, "ngram", gpus=True)
    assert args.count(vllm.TIMING_METRICS[0]) == 1  # a flag without a value: every pool's answers carry timings
    valued = [a for a in args if a not in vllm.TIMING_METRICS]
    flags = dict(zip(valued[:-2:2], valued[1:-2:2]))
    assert flags == {"--model": "/models/llama", "--served-model-name": "llama", "--host": "0.0.0.0", "--port": "8000",
                     "--dtype": "bfloat16", "--speculative-config": flags["--speculative-config"],
                     "--per-request-spec-decode-metrics": "summary"}
    assert args[-2:] == ["--max-model-len", "8192"]
    plain = vllm.server_args(s, s, "none", gpus=False)
    assert "--speculative-config" not in plain and "--per-request-spec-decode-metrics" not in plain
    assert vllm.TIMING_METRICS[0] in plain  # the plain pool's timings are the speedups' baseline
    assert plain[plain.index("--dtype") + 1] == "float32"  # auto as specfleet means it, on the CPU
    assert vllm.server_args(spec(dtype="bfloat16"), spec(dtype="bfloat16"), "none", False)[9] == "bfloat16"
    assert [a for a in args if vllm.owned_arg(a)] == ["--model", "--served-model-name", "--host", "--port", "--dtype",
                                                      "--enable-per-request-metrics", "--speculative-config",
                                                      "--per-request-spec-decode-metrics"]


def test_the_target_folder_is_model_uris_path_a_relative_one_in_the_model_cache():
    assert vllm.model_path(spec(model={"name": "m", "uri": "Llama-3.1-8B"})) == "/var/cache/specfleet/Llama-3.1-8B"
    assert vllm.model_path(spec(model={"name": "m", "uri": "file:///opt/m"})) == "/opt/m"


def test_images_are_pinned_upstream_ones_by_gpu_unless_the_spec_names_one():
    assert vllm.image(spec(), gpus=True) == "vllm/vllm-openai:v0.32.0"
    assert vllm.image(spec(), gpus=False) == "vllm/vllm-openai-cpu:v0.32.0-x86_64"
    pinned = "registry.example/vllm@sha256:" + "a" * 64
    assert vllm.image(spec(engine={"name": "vllm", "vllm": {"image": pinned}}), gpus=False) == pinned


@pytest.mark.parametrize("arg, owned", [
    ("--model", True), ("--model=/x", True), ("--mod", True), ("--served_model_name", True), ("--served", True),
    ("--speculative-config", True), ("--speculative_config.method", True), ("--specul=x", True),
    ("--per-request-spec-decode-metrics=detailed", True), ("--dtype", True), ("--quantization", True), ("-q", True),
    ("-qfp8", True), ("-sc", True), ("--host", True), ("--port=9000", True), ("--config", True),
    ("--model-impl", False), ("--max-model-len", False), ("--tokenizer", False), ("--seed", False), ("-tp", False),
    ("--gpu-memory-utilization=0.8", False), ("8192", False), ("--enable-prefix-caching", False),
    ("--config-format", False),
    ("--kv-cache-dtype", False), ("-O3", False),
])
def test_owned_flags_in_any_spelling_vllms_parser_reads_as_one(arg, owned):
    assert vllm.owned_arg(arg) is owned


def test_an_arm_runs_a_pool_per_method_its_routing_can_name_and_a_plain_one():
    # ngram only: nothing to choose, ngram and the plain pool
    assert vllm.pool_methods(spec()) == ("ngram", "none")
    # a head: the loop chooses between it and ngram (routing.select, on by default)
    eagle = spec(draft={"method": "eagle", "uri": "/heads/e"})
    assert vllm.pool_methods(eagle) == ("ngram", "eagle", "none")
    assert vllm.pool_methods({**eagle, "routing": {"select": {"enabled": False}}}) == ("eagle", "none")
    # pins name pools too, even where the loop chooses nothing
    pinned = {**eagle, "routing": {"select": {"enabled": False}, "byPromptType": {"code": "ngram"}}}
    assert vllm.pool_methods(pinned) == ("ngram", "eagle", "none")
    assert vllm.pool_methods(spec(draft={"method": "none"})) == ("none",)
    assert vllm.pool_methods(spec(draft={"method": "none"}, routing={"default": "ngram"})) == ("ngram", "none")


def test_the_canary_runs_the_pools_of_its_own_method_and_a_promotion_moves_stables():
    s = spec(draft={"method": "eagle", "uri": "/heads/e"},
             canary={"weight": 5, "replicas": 2, "overrides": {"draft": {"method": "medusa", "uri": "/heads/m"}}})
    assert vllm.pool_methods(s, "canary") == ("ngram", "medusa", "none")
    promoted = fs.FleetState(promoted={"overrides": s["canary"]["overrides"], "base": {k: s[k] for k in ("draft",)}})
    assert vllm.pool_methods(s, "stable", promoted) == ("ngram", "medusa", "none")
    pools = [(p.role, p.method, p.replicas) for p in vllm.pools(s)]
    assert pools == [("stable", "ngram", 3), ("stable", "eagle", 3), ("stable", "none", 3),
                     ("canary", "ngram", 2), ("canary", "medusa", 2), ("canary", "none", 2)]
    ended = vllm.pools(s, fs.FleetState(canary_phase="Aborted"))
    assert [p.replicas for p in ended if p.role == "canary"] == [0, 0, 0]  # as the canary's workers


def test_a_pool_of_its_own_size():
    s = spec(engine={"name": "vllm", "vllm": {"pools": {"none": {"replicas": 1}, "medusa": {"replicas": 9}}}})
    assert [(p.method, p.replicas) for p in vllm.pools(s)] == [("ngram", 3), ("none", 1)]


@pytest.mark.parametrize("over, field", [
    ({"speculation": {**BASE["speculation"], "kPolicy": "confidence"}}, "spec.speculation.kPolicy"),
    ({"speculation": {**BASE["speculation"], "kInitial": 3}}, "spec.speculation.kMax"),
    ({"speculation": {**BASE["speculation"], "tree": {"branching": 3, "depth": 0}}}, "spec.speculation.tree"),
    ({"quantization": "int8"}, "spec.quantization"),
    ({"canary": {"overrides": {"speculation": {"kMax": 7}}}}, "spec.canary.overrides.speculation.kMax"),
    ({"canary": {"overrides": {"image": "w:2"}}}, "spec.canary.overrides.image"),
    ({"routing": {"byPromptType": {"math": "draft-model"}}}, "spec.routing"),
    ({"engine": {"name": "vllm", "vllm": {"args": ["--seed", "7", "--port", "1"]}}}, "spec.engine.vllm.args[2]"),
])
def test_what_vllm_cannot_serve_is_named_by_the_field_that_asked(over, field):
    assert [p.field for p in vllm.problems(spec(**over))] == [field]


def test_a_spec_for_specfleets_workers_is_not_judged_here():
    adaptive = spec(speculation={**BASE["speculation"], "kPolicy": "adaptive"})
    theirs = {k: v for k, v in adaptive.items() if k != "engine"}
    assert vllm.engine(theirs) == vllm.SPECFLEET and vllm.problems(theirs) == []
