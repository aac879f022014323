"""`specfleet bench --configs`: the names it reads (no model is loaded): PRECISION/METHOD[@KPOLICY],
mixed drafts, every served K policy by name."""

import doctest
import re

import pytest

from specfleet_api.enums import SERVED_K_POLICIES
from specfleet_bench import spec_bench
from specfleet_bench.spec_bench import parse_configs


def test_the_doctests():
    assert doctest.testmod(spec_bench).failed == 0


def test_mixed_configs_name_a_head_chain_or_tree_with_ngram_after_it():
    got = parse_configs("fp32/ngram,fp32/eagle-tree,fp32/eagle-tree+ngram,fp32/eagle+ngram,int8/medusa+ngram")
    assert got == [("fp32", "none"), ("fp32", "ngram"), ("fp32", "eagle-tree"), ("fp32", "eagle-tree+ngram"),
                   ("fp32", "eagle+ngram"), ("int8", "medusa+ngram")]


@pytest.mark.parametrize("item", ["fp32/ngram+ngram", "fp32/none+ngram", "fp32/eagle+ngram-tree", "fp32/eagle-corpus+ngram",
                                  "hf/plain+ngram"])
def test_mixing_into_what_is_not_a_head_is_refused_naming_the_item(item):
    with pytest.raises(ValueError, match=re.escape(f"--configs: {item!r} is not PRECISION/METHOD")):
        parse_configs(item)


def test_a_mixed_config_runs_the_heads_proposer_with_its_own_ngram_one_and_counts_the_ngrams_share():
    """Runner.run on a tiny engine (no model loaded): eagle-tree+ngram decodes as plain decoding
    does, and reports the accepted tokens the n-gram's chains drafted."""
    from specfleet_engine.engine import Engine
    from specfleet_engine.proposers import MixedProposer
    from specfleet_engine.proposers.eagle import EagleProposer
    from specfleet_engine.testing import repeating_prompts, tiny_head, tiny_model

    target = tiny_model(seed=1, scale=4.0, vocab_size=20)
    prompts = repeating_prompts(2, seed=5, vocab=9)
    engine = Engine(target, proposers={"eagle": EagleProposer(tiny_head(target, prompts, steps=40), target)})
    runner = object.__new__(spec_bench.Runner)
    runner.engines, runner.proposers, runner.max_tokens, runner.k, runner.tree_branching = {"fp32": engine}, {}, 24, 4, 2
    runner.corpus_tokens, runner.recycle, runner.policies = 0, 0, {}
    ngram_total = 0
    for prompt in prompts:
        plain = runner.run("fp32", "none", prompt, 0)
        mixed = runner.run("fp32", "eagle-tree+ngram", prompt, 0)
        assert mixed[0] == plain[0] and mixed[3] > 0 and plain[5] == 0
        ngram_total += mixed[5]
    assert isinstance(engine.proposers["eagle+ngram"], MixedProposer)
    assert engine.proposers["eagle+ngram"].ngram is runner.proposers["fp32", "eagle-tree+ngram"]
    assert ngram_total > 0


def test_every_served_k_policy_is_a_config_suffix():
    configs = parse_configs(",".join(f"fp32/eagle@{p}" for p in SERVED_K_POLICIES) + ",fp32/eagle-tree@confidence")
    assert configs == [("fp32", "none"), *(("fp32", f"eagle@{p}") for p in SERVED_K_POLICIES),
                       ("fp32", "eagle-tree@confidence")]


@pytest.mark.parametrize("bad", ["fp32/eagle@eagle2", "fp32/none@entropy", "hf/plain@confidence"])
def test_a_bad_k_policy_suffix_is_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match="@KPOLICY must be one of adaptive, fixed, confidence, entropy"):
        parse_configs(bad)
