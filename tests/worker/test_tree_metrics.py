"""spec_decode_tree_branch_factor is the branching the steps verified (draft tokens per draft level
over the recent window), not the configured cap. The engine's steps are reshaped into trees here:
what is tested is the worker's reading of StepStats, not the engine's tree path."""
from __future__ import annotations

import dataclasses
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from specfleet_api.enums import Method
from specfleet_engine.factory import mix_ngram
from specfleet_engine.proposers import default_proposers
from specfleet_engine.proposers.draft_model import DraftModelProposer
from specfleet_engine.testing import tiny_model
from specfleet_worker.testing import TINY, pb, running_worker, tiny_engine, wait_idle

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repeats: n-gram drafts from the first steps


def branch_factor(r) -> float:
    text = urllib.request.urlopen(r.http + "/metrics", timeout=10).read().decode()
    (value,) = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "spec_decode_tree_branch_factor"]
    return value


def reshaping(engine, shape: dict):
    """engine.step, each verified draft reported as a tree of shape["nodes"] draft tokens over
    shape["depth"] levels while `shape` is set (the accepted path no longer than the depth)."""
    step = engine.step

    def tree_step():
        outs = step()
        if not shape:
            return outs
        return [dataclasses.replace(o, stats=dataclasses.replace(
                    o.stats, num_draft_tokens=shape["nodes"], draft_depth=shape["depth"],
                    num_accepted=min(o.stats.num_accepted, shape["depth"])))
                if o.stats is not None and o.stats.num_draft_tokens else o for o in outs]
    return tree_step


def test_the_gauge_reads_the_branching_verified_not_the_cap():
    engine, shape = tiny_engine(), {}
    engine.step = reshaping(engine, shape)
    with running_worker(engine, dataclasses.replace(TINY, tree_branching=4)) as r:
        assert branch_factor(r) == 1.0  # nothing verified yet: read as chains, not as the cap
        assert r.admin.GetConfig(pb.GetConfigRequest()).tree_branching == 4

        def serve():
            resp = r.gen.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=48, ignore_eos=True),
                                  timeout=60)
            wait_idle(r)
            return resp.speculation

        shape.update(nodes=6, depth=3)
        spec = serve()
        stats = r.stats()
        assert stats.num_drafts > 0  # the steps did verify drafts
        assert branch_factor(r) == 2.0  # 6 nodes over 3 levels, in every step
        # alpha counts positions (the depth), the nodes are counted apart: a tree's alpha reads like a chain's
        assert stats.num_draft_tokens == 3 * stats.num_drafts and stats.num_draft_nodes == 6 * stats.num_drafts
        assert spec.num_draft_tokens > 0  # the request's own stats are the engine's (tests/engine/test_stats.py)
        assert spec.spec_plain_seconds > 0 and spec.spec_busy_seconds > 0  # its speculating steps' seconds
        shape.clear()  # the real engine's chains: the window moves toward 1 and remembers the trees
        drafts = r.stats().num_drafts
        serve()
        assert r.stats().num_drafts > drafts
        assert 1.0 < branch_factor(r) < 2.0


def test_get_config_reports_the_latency_guard_the_corpus_the_shape_and_the_device_the_engine_runs():
    engine = tiny_engine(proposers=default_proposers(ngram_corpus_tokens=4096), k_policy="adaptive",
                         max_slowdown=0.03, tree_branching=2, tree_choices=[[0, 0], [1], [0]])
    with running_worker(engine) as r:
        cfg = r.admin.GetConfig(pb.GetConfigRequest())
        assert (cfg.latency_guard_percent, cfg.ngram_corpus_tokens, cfg.device) == (3, 4096, "cpu")
        assert [list(p.ranks) for p in cfg.tree_choices] == [[0], [1], [0, 0]]  # by depth, then rank
        assert cfg.ngram_mix is False
    with running_worker() as r:  # the defaults: no guard, no corpus, no shape
        cfg = r.admin.GetConfig(pb.GetConfigRequest())
        assert (cfg.latency_guard_percent, cfg.ngram_corpus_tokens, len(cfg.tree_choices)) == (0, 0, 0)
    # draft.ngram.mix: the draft model's trees with the n-gram chain mixed in (factory.mix_ngram)
    mixed = mix_ngram({**default_proposers(), Method.DRAFT_MODEL.value: DraftModelProposer(tiny_model(seed=2))})
    with running_worker(tiny_engine(proposers=mixed)) as r:
        cfg = r.admin.GetConfig(pb.GetConfigRequest())
        assert cfg.ngram_mix is True and Method.DRAFT_MODEL.value in cfg.methods


def test_mixed_drafts_count_the_ngram_chains_accepted_tokens_by_prompt_type():
    """StepStats' n-gram chain of a mixed draft (reported here on the n-gram's steps) reaches
    spec_decode_num_ngram_drafts and _num_ngram_accepted_tokens under the request's prompt type."""
    engine = tiny_engine()
    step = engine.step

    def mixed_step():
        return [dataclasses.replace(o, stats=dataclasses.replace(o.stats, ngram_nodes=o.stats.num_draft_tokens,
                                                                 ngram_accepted=o.stats.num_accepted))
                if o.stats is not None and o.stats.num_draft_tokens else o for o in step()]

    engine.step = mixed_step
    with running_worker(engine, TINY) as r:
        r.gen.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=48, ignore_eos=True, prompt_type="code"),
                       timeout=60)
        wait_idle(r)
        stats = r.stats()
        text = urllib.request.urlopen(r.http + "/metrics", timeout=10).read().decode()
    samples = {(s.name, s.labels.get("prompt_type")): s.value for f in text_string_to_metric_families(text)
               for s in f.samples}
    assert samples["spec_decode_num_ngram_drafts_total", "code"] == stats.num_drafts > 0
    assert samples["spec_decode_num_ngram_accepted_tokens_total", "code"] == stats.num_accepted_tokens > 0
