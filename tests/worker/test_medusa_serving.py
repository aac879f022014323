"""`draft.method: medusa` served end to end: `specfleet serve` reads an engine.json naming a folder
of Medusa heads (trained on the tiny model in seconds), builds their proposer and answers over
gRPC with plain decoding's greedy tokens, drafting with the heads; `--check-config` refuses heads
trained for another target, or of another kind, naming what differs.
"""
from __future__ import annotations

import json
import urllib.request

import pytest

from specfleet_engine.draft_head import save_head
from specfleet_engine.engine import Engine
from specfleet_engine.sampling import SamplingParams
from specfleet_engine.testing import repeating_prompts, tiny_head, tiny_medusa_head, tiny_model
from specfleet_worker.main import check_config
from specfleet_worker.testing import WorkerProcess, pb

RPC_S = 60
PROMPTS = repeating_prompts(8)[:4]  # among the heads' training prompts: their drafts get accepted
MAX_TOKENS = 32


def the_served_target():
    """The tiny model as the worker builds it for `model.name: tiny-random` (same seed, same scale)."""
    return tiny_model(seed=0, scale=4.0)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """Medusa heads trained for the served tiny model, saved as `specfleet train-draft` saves them."""
    return save_head(tiny_medusa_head(the_served_target()), tmp_path_factory.mktemp("medusa") / "heads")


def engine_json(path, heads, **speculation) -> str:
    path.write_text(json.dumps({
        "model": {"name": "tiny-random"}, "draft": {"method": "medusa", "uri": str(heads)},
        "speculation": {"kMin": 4, "kMax": 4, "kInitial": 4, "kPolicy": "fixed", **speculation}}))
    return str(path)


@pytest.mark.parametrize("tree", [{}, {"tree": {"branching": 2, "depth": 4}}], ids=["chains", "trees"])
def test_the_worker_serves_medusa_with_plain_decodings_greedy_tokens(tmp_path, heads, tree):
    target = the_served_target()
    plain = Engine(target, proposers={})
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [plain.generate(p, params, "none").output for p in PROMPTS]
    config = engine_json(tmp_path / "engine.json", heads, **tree)
    assert check_config(config) == 0  # the heads fit the target, as the worker checks before it starts
    with WorkerProcess(config, "--threads", "1", "--max-batch-size", "2") as w:
        assert "medusa" in w.admin.GetConfig(pb.GetConfigRequest()).methods
        results = [w.gen.Generate(pb.GenerateRequest(prompt_token_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True),
                                  timeout=RPC_S) for p in PROMPTS]
        metrics = urllib.request.urlopen(f"{w.http}/metrics", timeout=10).read().decode()
    assert [list(r.token_ids) for r in results] == expected  # lossless
    assert {r.speculation.method for r in results} == {"medusa"}  # routing.default follows draft.method
    drafted = sum(r.speculation.num_draft_tokens for r in results)
    accepted = sum(r.speculation.num_accepted_tokens for r in results)
    assert drafted > 0 and accepted > 0, (drafted, accepted)  # the heads drafted, and were right sometimes
    # the worker's counters saw the same drafts (only Medusa drafted in this worker)
    counted = [line for line in metrics.splitlines() if line.startswith("spec_decode_num_draft_tokens_total{")]
    assert counted and sum(float(line.rsplit(" ", 1)[1]) for line in counted) == drafted


def test_check_config_refuses_medusa_heads_that_do_not_fit_naming_what_differs(tmp_path, heads, capsys):
    other = save_head(tiny_medusa_head(tiny_model(seed=2, n_layers=3), steps=1), tmp_path / "other")
    assert check_config(engine_json(tmp_path / "other.json", other)) == 2
    out, err = capsys.readouterr()
    assert out == "" and ("draft.uri: the Medusa heads do not fit the target: the head was trained for a target "
                          "with layers 3, this target has 2") in err
    # an EAGLE head is not Medusa heads
    eagle = save_head(tiny_head(the_served_target(), steps=1), tmp_path / "eagle")
    assert check_config(engine_json(tmp_path / "eagle.json", eagle)) == 2
    assert "a 'specfleet-eagle/1' head, where a 'specfleet-medusa/1' one is wanted" in capsys.readouterr().err
    # no folder at all: named, as the worker looks for it (as is, then in the model cache)
    assert check_config(engine_json(tmp_path / "none.json", tmp_path / "nowhere")) == 2
    assert f"draft.uri: no Medusa heads here: no folder at {tmp_path / 'nowhere'}" in capsys.readouterr().err
    # the heads that fit pass, in one line
    assert check_config(engine_json(tmp_path / "fits.json", heads)) == 0
    assert "draft medusa" in capsys.readouterr().out


@pytest.mark.parametrize("method, kwarg", [("medusa", "medusa_head"), ("eagle", "draft_head")])
def test_a_real_model_gets_its_learned_heads_from_the_factory(tmp_path, monkeypatch, method, kwarg):
    """Past the tiny model, the worker hands draft.uri's folder to the engine factory as the
    method's heads (and no other kind's); a real model's load is the factory's own tests' part."""
    from specfleet_engine import factory
    from specfleet_worker.config import EngineConfig
    from specfleet_worker.main import _build_engine

    seen = {}

    def parts(*args, **kw):
        seen.update(kw)
        return tiny_model(), None, {}

    monkeypatch.setattr(factory, "build_engine_parts", parts)
    (tmp_path / "heads").mkdir()
    cfg = EngineConfig(model_name="m", draft_method=method, draft_uri=str(tmp_path / "heads"), default_method=method)
    _build_engine(cfg, max_kv_tokens=256, threads=None, max_batch_size=1)
    other = {"medusa_head": "draft_head", "draft_head": "medusa_head"}[kwarg]
    assert seen[kwarg] == str(tmp_path / "heads") and seen[other] is None
