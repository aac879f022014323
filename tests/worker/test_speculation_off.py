"""The two ways speculation goes off, on a real worker. The soft off (the live state's and
control.json's `speculate: false`, the fleet's fallback) runs every request plain except the
router's probes (`probe` set), which still speculate with their method; the hard off
(Admin.UpdateConfig's `speculation_enabled=false`, the operator's emergency switch) runs every
request plain. Both reach running requests at their next step."""
from __future__ import annotations

import dataclasses
import threading

from specfleet_api.live_state import KBounds, LiveState
from specfleet_engine.proposers import default_proposers
from specfleet_worker.testing import TINY, SlowProposer, pb, running_worker, tiny_engine, wait_for

RPC_S = 30
PROMPT = [7] * 10  # the tiny model accepts n-gram drafts after it
FALLBACK = LiveState(version=1, speculate=False, k={"stable": KBounds(0, 0)})  # as the operator writes it


def generate(r, method: str, probe: bool = False) -> pb.SpeculationStats:
    return r.gen.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=40, ignore_eos=True,
                                             speculation_method=method, prompt_type="code", probe=probe),
                          timeout=RPC_S).speculation


def config(r) -> tuple[bool, bool]:
    c = r.admin.GetConfig(pb.GetConfigRequest())
    return c.speculation_enabled, c.default_speculate


def test_the_soft_off_leaves_the_probes_and_the_hard_off_stops_everything():
    with running_worker(cfg=dataclasses.replace(TINY, by_prompt_type={"code": "ngram"})) as r:
        assert generate(r, "").method == "ngram" and config(r) == (True, True)
        r.worker.live.apply_live_state(FALLBACK, "stable")
        assert config(r) == (True, False)
        for named in ("", "auto", "ngram"):  # naming a method is not enough: only the probe speculates
            s = generate(r, named)
            assert s.method == "none" and s.num_draft_tokens == 0
        probe = generate(r, "ngram", probe=True)
        assert probe.method == "ngram" and probe.num_draft_tokens > 0 and probe.num_accepted_tokens > 0
        assert generate(r, "", probe=True).method == "ngram"  # a probe left to routing takes its route

        r.admin.UpdateConfig(pb.UpdateConfigRequest(speculation_enabled=False))
        assert config(r) == (False, False)
        s = generate(r, "ngram", probe=True)
        assert s.method == "none" and s.num_draft_tokens == 0
        r.worker.live.apply_live_state(LiveState(version=2, k={"stable": KBounds(0, 8)}), "stable")
        assert config(r) == (False, True)  # the live state does not lift the operator's hard off
        assert generate(r, "ngram", probe=True).method == generate(r, "").method == "none"

        r.admin.UpdateConfig(pb.UpdateConfigRequest(speculation_enabled=True))
        assert generate(r, "").method == "ngram" and generate(r, "ngram").num_draft_tokens > 0


def test_running_requests_follow_each_switch_at_their_next_step():
    proposers = {**default_proposers(), "slow": SlowProposer(0.005)}  # keeps both requests running a while
    with running_worker(tiny_engine(proposers=proposers), cfg=dataclasses.replace(TINY, default_method="slow")) as r:
        sch = r.worker.scheduler
        results: dict[str, pb.GenerateResponse] = {}

        def run(probe: bool):
            results[probe] = r.gen.Generate(pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=300,
                                                               ignore_eos=True, probe=probe), timeout=RPC_S)

        threads = [threading.Thread(target=run, args=(p,)) for p in (False, True)]
        for t in threads:
            t.start()
        running = wait_for(lambda: len(sch._active) == 2 and {q.probe: q for q in sch._active}, 10,
                           "both requests running")
        regular, probe = running[False].seq, running[True].seq
        wait_for(lambda: regular.stats.num_drafts and probe.stats.num_drafts, 10, "drafts in both")

        r.worker.live.apply_live_state(FALLBACK, "stable")  # soft: the regular one stops drafting
        wait_for(lambda: regular.k_max == 0, 5, "the regular request's next step")
        regular_drafts, probe_drafts = regular.stats.num_draft_tokens, probe.stats.num_draft_tokens
        assert probe.k_max > 0
        wait_for(lambda: probe.stats.num_draft_tokens > probe_drafts, 5, "the probe drafting on")
        assert regular.stats.num_draft_tokens == regular_drafts

        r.admin.UpdateConfig(pb.UpdateConfigRequest(speculation_enabled=False))  # hard: the probe stops too
        wait_for(lambda: probe.k_max == 0, 5, "the probe's next step")
        probe_drafts = probe.stats.num_draft_tokens
        for t in threads:
            t.join(RPC_S)
        assert results[False].speculation.num_draft_tokens == regular_drafts
        assert results[True].speculation.num_draft_tokens == probe_drafts
        assert len(results[False].token_ids) == len(results[True].token_ids) == 300
