"""specfleet_api.limits is the one home of the wire's limits and defaults: every component that
enforces one enforces that value (at the limit passes, one past it fails), the CRD's YAML states
the same numbers, and no Python file outside api/ spells one out again."""
from __future__ import annotations

import ast
import pathlib

import pytest
import yaml

from specfleet_api import limits
from specfleet_api.engine_config import EngineConfig
from specfleet_api.limits import (
    K_LIMIT, MAX_DRAFT_NODES, MAX_REQUEST_ID, OPENAI_DEFAULT_TEMPERATURE, WIRE_DEFAULT_TEMPERATURE, is_greedy,
)
from specfleet_api.live_state import KBounds, LiveState

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "serving.specfleet.dev_specdecodedeployments.yaml"
PACKAGES = ["cli", "control", "local", "operator", "router", "worker", "bench"]


def test_the_docstrings_hold():
    import doctest

    assert doctest.testmod(limits).failed == 0


def _speculation(where: str) -> dict:
    spec = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    node = spec["properties"]["speculation"] if where == "spec" else \
        spec["properties"]["canary"]["properties"]["overrides"]["properties"]["speculation"]
    return node["properties"]


@pytest.mark.parametrize("where", ["spec", "canary.overrides"])
@pytest.mark.parametrize("field", ["kMin", "kMax", "kInitial"])
def test_the_crd_bounds_k_by_the_one_limit(where, field):
    """The CRD is YAML (and its chart and operator copies byte-equal it: tests/operator): its K
    bounds are checked against K_LIMIT here."""
    k = _speculation(where)[field]
    assert (k["type"], k["minimum"], k["maximum"]) == ("integer", 0, K_LIMIT)


def test_engine_json_takes_k_max_up_to_the_limit():
    at = EngineConfig.from_dict({"speculation": {"kMax": K_LIMIT}}, check=False)
    past = EngineConfig.from_dict({"speculation": {"kMax": K_LIMIT + 1}}, check=False)
    assert not [p for p in at.problems() if p.field.startswith("speculation")]
    assert [p.field for p in past.problems()] == ["speculation.kMax"]


def test_the_live_state_takes_k_up_to_the_limit():
    assert LiveState(version=1, k={"stable": KBounds(0, K_LIMIT)}).problems() == []
    assert LiveState(version=1, k={"stable": KBounds(0, K_LIMIT + 1)}).problems()


def test_the_worker_takes_live_k_up_to_the_limit():
    from specfleet_worker.config import LiveConfig

    live = LiveConfig(EngineConfig(), ["ngram"])
    assert live.update(k_min=0, k_max=K_LIMIT).k_max == K_LIMIT
    with pytest.raises(ValueError, match=f"<= {K_LIMIT}"):
        live.update(k_max=K_LIMIT + 1)


def test_a_request_reserves_kv_for_the_largest_draft():
    """A request's worst case: its context plus MAX_DRAFT_NODES draft rows plus the root."""
    from specfleet_worker.scheduler import Scheduler

    class Engine:
        max_len = 10_000

        class cache:
            block_size = 1

    class Bare(Scheduler):
        def __init__(self):
            self.engine = Engine()

    assert MAX_DRAFT_NODES >= K_LIMIT  # a chain of the longest K fits
    assert Bare().blocks_needed(100, 50) == 150 + MAX_DRAFT_NODES + 1


def test_request_ids_end_at_the_one_limit():
    from specfleet_proto import worker_pb2 as pb
    from specfleet_worker.service import Invalid, Worker

    from specfleet_router import drift

    check = Worker._check_envelope.__get__(type("S", (), {"max_request_bytes": 1 << 20})())
    check(pb.GenerateRequest(request_id="r" * MAX_REQUEST_ID))
    with pytest.raises(Invalid, match=f"the limit is {MAX_REQUEST_ID}"):
        check(pb.GenerateRequest(request_id="r" * (MAX_REQUEST_ID + 1)))
    mirror = drift.Drift._mirror_id(None, "r" * MAX_REQUEST_ID, "canary")
    assert len(mirror) == MAX_REQUEST_ID and mirror != "r" * MAX_REQUEST_ID


def test_the_http_front_defaults_to_openai_temperature_and_grpc_to_greedy():
    from specfleet_router import main as router_main
    from specfleet_router.openai_api import parse_chat, parse_completion
    from specfleet_router.server import RouterConfig

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert OPENAI_DEFAULT_TEMPERATURE == 1.0 and WIRE_DEFAULT_TEMPERATURE == 0.0  # OpenAI's; the proto's
    assert parse_chat(chat).temperature == OPENAI_DEFAULT_TEMPERATURE
    assert parse_completion({"model": "m", "prompt": "hi"}).temperature == OPENAI_DEFAULT_TEMPERATURE
    assert parse_chat(chat).to_proto("r").temperature == OPENAI_DEFAULT_TEMPERATURE  # always sent to the worker
    assert RouterConfig.__dataclass_fields__["default_temperature"].default == OPENAI_DEFAULT_TEMPERATURE
    assert router_main.build_parser().get_default("default_temperature") == OPENAI_DEFAULT_TEMPERATURE
    assert is_greedy(None)  # an unset gRPC temperature


@pytest.mark.parametrize("temperature", [0.0, 1e-40, 1e-7, 9.99e-6, 1e-5, 1e-3, 0.7, 1.0])
def test_one_meaning_of_greedy(temperature):
    """The engine, the worker and the router's drift check decide greedy alike."""
    from specfleet_engine.sampling import SamplingParams
    from specfleet_proto import worker_pb2 as pb

    from specfleet_router.drift import greedy

    expected = temperature < limits.GREEDY_BELOW
    assert is_greedy(temperature) == expected
    assert SamplingParams(temperature=temperature).greedy == expected
    assert greedy(pb.GenerateRequest(temperature=temperature)) == expected
    assert greedy(pb.GenerateRequest()) and SamplingParams().greedy  # unset: the wire's default


def test_a_tiny_temperature_decodes_greedily_instead_of_nan():
    """Dividing float32 logits by T = 1e-40 gives NaN probabilities; such a T is greedy."""
    import torch

    from specfleet_engine.sampling import SamplingParams, sample

    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    assert int(sample(logits, SamplingParams(temperature=1e-40), None)) == 1


#: names of wire limits and defaults: a module-level constant of one of these names, or a
#: parameter named so with a number for its default, belongs in specfleet_api.limits
LIMIT_NAMES = {"K_LIMIT", "MAX_K", "MAX_DRAFT_NODES", "MAX_REQUEST_ID"}


def spelled_out(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, what) of each limit or default temperature given a number of its own."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for t in node.targets:
                if isinstance(t, ast.Name) and (t.id in LIMIT_NAMES or "TEMPERATURE" in t.id):
                    out.append((node.lineno, t.id))
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(node.value, ast.Constant):
            if "temperature" in node.target.id.lower() and isinstance(node.value.value, float):
                out.append((node.lineno, node.target.id))
        if isinstance(node, ast.FunctionDef):
            args = node.args.args + node.args.kwonlyargs
            defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults \
                + node.args.kw_defaults
            for a, d in zip(args, defaults):
                if "temperature" in a.arg and isinstance(d, ast.Constant) and isinstance(d.value, float):
                    out.append((d.lineno, a.arg))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and any(
                isinstance(a, ast.Constant) and a.value == "--default-temperature" for a in node.args):
            out += [(k.value.lineno, "--default-temperature") for k in node.keywords
                    if k.arg == "default" and isinstance(k.value, ast.Constant)]
        if isinstance(node, ast.keyword) and node.arg == "temperature" and isinstance(node.value, ast.IfExp) \
                and isinstance(node.value.orelse, ast.Constant):  # `x if msg.HasField(...) else 0.0`
            out.append((node.value.lineno, "temperature when unset"))
        if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == K_LIMIT
                                                 for c in node.comparators):
            out.append((node.lineno, f"a comparison with {K_LIMIT}"))
    return sorted(out)


#: Files that still spell one out, each with its reason; shrink it, never grow it.
KNOWN: set[str] = set()


def test_no_component_spells_out_a_limit_or_a_default_temperature_of_its_own():
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if "_pb2" in rel:
                continue
            hits = spelled_out(path)
            if hits:
                found[rel] = hits
    assert set(found) <= KNOWN, {k: v for k, v in found.items() if k not in KNOWN}


def test_the_scan_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("MAX_K = 32\nMAX_REQUEST_ID = 128\nclass J:\n    temperature: float = 1.0\n"
                   "def f(x, default_temperature: float = 1.0):\n    return 0 <= x <= 32\n"
                   "p.add_argument('--default-temperature', type=float, default=1.0)\n"
                   "P(temperature=m.temperature if m.HasField('temperature') else 0.0)\n")
    assert [line for line, _ in spelled_out(bad)] == [1, 2, 4, 5, 6, 7, 8]
