"""The CRD: one source of truth, a valid structural schema, examples that pass it, and CEL
rules evaluated for real (cel-python) so that a rule rejecting a good resource, or accepting a
bad one, fails here. The operator's own checks (spec.problems) must agree with the CEL rules.
"""
import copy
import pathlib

import celpy
import celpy.celtypes as ct
import jsonschema
import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings, strategies as st

from specfleet_operator import spec as specs

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "serving.specfleet.dev_specdecodedeployments.yaml"
CRD = yaml.safe_load(CRD_FILE.read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))


def test_copies_are_byte_identical():
    canonical = CRD_FILE.read_bytes()
    assert (ROOT / "charts" / "specfleet" / "crds" / CRD_FILE.name).read_bytes() == canonical
    assert (ROOT / "operator" / "specfleet_operator" / "crd.yaml").read_bytes() == canonical


def test_crd_is_a_valid_kubernetes_object():
    kubernetes_validate.validate(CRD, "1.30", strict=True)
    version = CRD["spec"]["versions"][0]
    assert CRD["spec"]["names"]["shortNames"] == ["sdd"] and CRD["spec"]["scope"] == "Namespaced"
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Ready", "Mode", "Alpha", "K", "Canary", "Age"]


def _walk(node, path="$"):
    yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    for path, node in _walk(SCHEMA):
        if path == "$.metadata":
            continue
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if node.get("type") == "object" and path != "$.metadata":
            assert "properties" in node or "additionalProperties" in node, f"{path}: an object needs fields"


def validate_openapi(obj):
    jsonschema.Draft7Validator(SCHEMA).validate(obj)


def _is_sorted(values):
    items = list(values)
    return ct.BoolType(all(a <= b for a, b in zip(items, items[1:])))


_ENV = celpy.Environment()
_PROGRAMS = {}


def _program(rule):
    if rule not in _PROGRAMS:
        # isSorted() is Kubernetes' CEL list library; cel-python gets the same semantics here.
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule), functions={"isSorted": _is_sorted})
    return _PROGRAMS[rule]


def cel_failures(obj, node=SCHEMA, path="$"):
    """Messages of every x-kubernetes-validations rule that `obj` breaks."""
    out = []
    for rule in node.get("x-kubernetes-validations", []):
        verdict = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(obj)})
        assert isinstance(verdict, ct.BoolType), f"{path}: {rule['rule']} evaluated to {verdict!r}"
        if not verdict:
            out.append(rule["message"])
    if isinstance(obj, dict):
        for key, sub in node.get("properties", {}).items():
            if key in obj:
                out += cel_failures(obj[key], sub, f"{path}.{key}")
    if isinstance(obj, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(obj):
            out += cel_failures(item, node["items"], f"{path}[{i}]")
    return out


def defaulted(doc):
    doc = copy.deepcopy(doc)
    doc["spec"] = specs.with_defaults(doc["spec"])
    return doc


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_schema_and_cel(path):
    (doc,) = list(yaml.safe_load_all(path.read_text()))
    validate_openapi(doc)
    full = defaulted(doc)
    validate_openapi(full)
    assert cel_failures(full) == []
    assert specs.problems(full["spec"]) == []


def test_there_are_the_four_examples():
    assert {p.stem for p in EXAMPLES} == {"ngram", "draft-model", "eagle-tree", "canary-1pct"}
    methods = {yaml.safe_load(p.read_text())["spec"]["draft"]["method"] for p in EXAMPLES}
    assert methods == {"ngram", "draft-model", "eagle"}


GOOD = {"apiVersion": "serving.specfleet.dev/v1alpha1", "kind": "SpecDecodeDeployment",
        "metadata": {"name": "x"}, "spec": {"model": {"name": "m", "uri": "u"}, "replicas": 1}}

BAD = {
    "k out of order": ({"speculation": {"kMin": 5, "kInitial": 2, "kMax": 8}}, "kMin <= kInitial <= kMax"),
    "replicas and scaling": ({"scaling": {"maxReplicas": 3}}, "exactly one of spec.replicas and spec.scaling"),
    "neither replicas nor scaling": ({"replicas": None}, "exactly one of spec.replicas and spec.scaling"),
    "scaling min above max": ({"replicas": None, "scaling": {"minReplicas": 5, "maxReplicas": 3}},
                              "minReplicas must not exceed"),
    "tree without eagle": ({"speculation": {"tree": {"branching": 3, "depth": 4}}}, "needs draft.method eagle"),
    "draft model without uri": ({"draft": {"method": "draft-model"}}, "draft.uri is required"),
    "canary steps falling": ({"canary": {"steps": [{"weight": 50}, {"weight": 10}]}}, "must be rising"),
    "canary steps repeated": ({"canary": {"steps": [{"weight": 10}, {"weight": 10}]}}, "distinct"),
    "canary step below start": ({"canary": {"weight": 20, "steps": [{"weight": 10}]}}, "rise above canary.weight"),
    "canary override k": ({"canary": {"overrides": {"speculation": {"kMin": 6, "kMax": 2}}}}, "kMin must not exceed"),
    "metric without bound": ({"canary": {"analysis": {"metrics": [{"name": "alpha"}]}}}, "needs min or max"),
    "redis both": ({"redis": {"url": "redis://r", "secretRef": {"name": "s"}}}, "exactly one of redis.url"),
}


def _with(spec_over):
    doc = copy.deepcopy(GOOD)
    for key, value in spec_over.items():
        if value is None:
            doc["spec"].pop(key)
        else:
            doc["spec"][key] = value
    return defaulted(doc)


def test_good_resource_accepted():
    assert cel_failures(defaulted(GOOD)) == [] and specs.problems(defaulted(GOOD)["spec"]) == []


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_resources_rejected_by_cel_and_operator(case):
    over, message = BAD[case]
    doc = _with(over)
    validate_openapi(doc)  # only CEL can catch these
    failures = cel_failures(doc)
    assert any(message in f for f in failures), failures
    problems = specs.problems(doc["spec"])
    assert any(message in p.message for p in problems), problems


@pytest.mark.parametrize("over", [
    {"draft": {"method": "magic"}}, {"quantization": "int3"}, {"canary": {"weight": 101}},
    {"speculation": {"kMax": 99}}, {"slo": {"window": "five minutes"}}, {"model": {"name": "m"}},
])
def test_schema_rejects_enums_ranges_and_required(over):
    doc = copy.deepcopy(GOOD)
    doc["spec"].update(over)
    with pytest.raises(jsonschema.ValidationError):
        validate_openapi(doc)


weights = st.integers(0, 100)
spec_strategy = st.fixed_dictionaries({
    "method": st.sampled_from(specs.METHODS), "uri": st.booleans(),
    "k": st.tuples(st.integers(0, 32), st.integers(0, 32), st.integers(0, 32)),
    "branching": st.integers(1, 8), "replicas": st.booleans(), "scaling": st.booleans(),
    "scale": st.tuples(st.integers(1, 10), st.integers(1, 10)),
    "canary": st.none() | st.tuples(weights, st.lists(weights, max_size=4)),
    "redis": st.sampled_from([None, "url", "secret", "both"]),
})


@settings(max_examples=150, deadline=None)
@given(spec_strategy)
def test_operator_checks_agree_with_cel(drawn):
    s = {"model": {"name": "m", "uri": "u"}, "draft": {"method": drawn["method"]},
         "speculation": dict(zip(("kMin", "kInitial", "kMax"), drawn["k"]), tree={"branching": drawn["branching"]})}
    if drawn["uri"]:
        s["draft"]["uri"] = "hf://d"
    if drawn["replicas"]:
        s["replicas"] = 2
    if drawn["scaling"]:
        s["scaling"] = {"minReplicas": drawn["scale"][0], "maxReplicas": drawn["scale"][1]}
    if drawn["canary"] is not None:
        s["canary"] = {"weight": drawn["canary"][0], "steps": [{"weight": w} for w in drawn["canary"][1]]}
    redis = {"url": {"url": "redis://r"}, "secret": {"secretRef": {"name": "s"}},
             "both": {"url": "redis://r", "secretRef": {"name": "s"}}}.get(drawn["redis"])
    if redis:
        s["redis"] = redis
    doc = defaulted({**GOOD, "spec": s})
    validate_openapi(doc)
    assert (cel_failures(doc) == []) == (specs.problems(doc["spec"]) == [])
