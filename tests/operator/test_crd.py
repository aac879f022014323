"""The CRD: one source of truth, a valid structural schema, enums that are specfleet_api's, examples
that pass it (or are rejected as not supported yet, as each says), and CEL rules evaluated for real
(cel-python) so that a rule rejecting a good resource, or accepting a bad one, fails here. The
operator's own checks (spec.problems) must agree with the CEL rules.
"""
import copy
import pathlib
import re

import celpy
import celpy.celtypes as ct
import jsonschema
import kubernetes_validate
import pytest
import yaml
from hypothesis import event, given, settings, strategies as st
from specfleet_api import enums

from specfleet_operator import spec as specs
from specfleet_operator.testing import EXAMPLE_VERDICTS

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "serving.specfleet.dev_specdecodedeployments.yaml"
CRD = yaml.safe_load(CRD_FILE.read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))


def test_copies_are_byte_identical():
    canonical = CRD_FILE.read_bytes()
    assert (ROOT / "charts" / "specfleet" / "crds" / CRD_FILE.name).read_bytes() == canonical
    assert (ROOT / "operator" / "specfleet_operator" / "crd.yaml").read_bytes() == canonical
    # `kubectl apply -f` and Helm read every YAML file in these folders: the CRD must be the only one
    for folder in (ROOT / "crds", ROOT / "charts" / "specfleet" / "crds"):
        assert sorted(p.name for p in folder.iterdir() if p.suffix in (".yaml", ".yml", ".json")) == [CRD_FILE.name]


def test_crd_is_a_valid_kubernetes_object():
    kubernetes_validate.validate(CRD, "1.30", strict=True)
    version = CRD["spec"]["versions"][0]
    assert CRD["spec"]["names"]["shortNames"] == ["sdd"] and CRD["spec"]["scope"] == "Namespaced"
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Ready", "Reason", "Mode", "Alpha", "K", "Canary",
                                                                         "Not-In-Spec", "Age"]


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
        if node.get("type") == "object" and not node.get("x-kubernetes-preserve-unknown-fields"):
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


def as_typed(obj, node):
    """`obj` as CEL sees it in the API server: a `type: number` field is a double even when the
    YAML wrote an integer (weight: 1), so rules may do double arithmetic on it."""
    if node.get("type") == "number" and isinstance(obj, int) and not isinstance(obj, bool):
        return float(obj)
    if isinstance(obj, dict):
        props, extra = node.get("properties", {}), node.get("additionalProperties")
        return {k: as_typed(v, props.get(k, extra if isinstance(extra, dict) else {})) for k, v in obj.items()}
    if isinstance(obj, list) and isinstance(node.get("items"), dict):
        return [as_typed(v, node["items"]) for v in obj]
    return obj


def cel_failures(obj, node=SCHEMA, path="$"):
    """Messages of every x-kubernetes-validations rule that `obj` breaks; a rule's
    messageExpression, when it has one, gives the message (as the API server reports it)."""
    out = []
    typed = as_typed(obj, node)
    for rule in node.get("x-kubernetes-validations", []):
        verdict = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(typed)})
        assert isinstance(verdict, ct.BoolType), f"{path}: {rule['rule']} evaluated to {verdict!r}"
        if not verdict:
            if "messageExpression" in rule:
                message = _program(rule["messageExpression"]).evaluate({"self": celpy.json_to_cel(typed)})
                assert isinstance(message, (str, ct.StringType)), f"{path}: {rule['messageExpression']} -> {message!r}"
                out.append(str(message))
            else:
                out.append(rule["message"])
    if isinstance(obj, dict):
        for key, sub in node.get("properties", {}).items():
            if key in obj:
                out += cel_failures(obj[key], sub, f"{path}.{key}")
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for key in obj.keys() - node.get("properties", {}).keys():
                out += cel_failures(obj[key], extra, f"{path}.{key}")
    if isinstance(obj, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(obj):
            out += cel_failures(item, node["items"], f"{path}[{i}]")
    return out


def defaulted(doc):
    doc = copy.deepcopy(doc)
    doc["spec"] = specs.with_defaults(doc["spec"])
    return doc


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_schema_and_cel_or_are_rejected_as_not_supported_yet(path):
    (doc,) = list(yaml.safe_load_all(path.read_text()))
    validate_openapi(doc)
    full = defaulted(doc)
    validate_openapi(full)
    if EXAMPLE_VERDICTS[path.stem] in ("served", "vllm"):
        assert cel_failures(full) == []
        assert specs.problems(full["spec"]) == []
    else:
        failures = cel_failures(full)
        assert failures and all("is not supported yet" in f for f in failures), failures
        problems = specs.problems(full["spec"])
        assert problems and {p.reason for p in problems} == {specs.UNSUPPORTED}, problems
        assert "RESERVED, NOT SERVED YET" in path.read_text()  # the file says so to whoever reads it


def test_every_example_has_a_verdict():
    stems = {p.stem for p in EXAMPLES}
    assert stems <= set(EXAMPLE_VERDICTS), f"say whether {sorted(stems - set(EXAMPLE_VERDICTS))} is served"
    assert {"ngram", "canary-1pct", "draft-model", "eagle-tree", "medusa-tree"} <= stems
    methods = {yaml.safe_load(p.read_text())["spec"]["draft"]["method"] for p in EXAMPLES}
    assert methods == {"ngram", "draft-model", "eagle", "medusa"}


GOOD = {"apiVersion": "serving.specfleet.dev/v1alpha1", "kind": "SpecDecodeDeployment",
        "metadata": {"name": "x"}, "spec": {"model": {"name": "m", "uri": "u"}, "replicas": 1}}

BAD = {
    "k out of order": ({"speculation": {"kMin": 5, "kInitial": 2, "kMax": 8}}, "kMin <= kInitial <= kMax"),
    "replicas and scaling": ({"scaling": {"maxReplicas": 3}}, "exactly one of spec.replicas and spec.scaling"),
    "neither replicas nor scaling": ({"replicas": None}, "exactly one of spec.replicas and spec.scaling"),
    "scaling min above max": ({"replicas": None, "scaling": {"minReplicas": 5, "maxReplicas": 3}},
                              "minReplicas must not exceed"),
    "draft model without uri": ({"draft": {"method": "draft-model"}}, "draft.uri is required"),
    "ngram mixed into ngram drafts": ({"draft": {"method": "ngram", "ngram": {"mix": True}}},
                                      "draft.ngram.mix needs draft.method draft-model, eagle or medusa"),
    "ngram mixed into plain decoding": ({"draft": {"method": "none", "ngram": {"mix": True}}},
                                        "draft.ngram.mix needs draft.method draft-model, eagle or medusa"),
    "canary steps falling": ({"canary": {"steps": [{"weight": 50}, {"weight": 10}]}}, "must be rising"),
    "canary steps repeated": ({"canary": {"steps": [{"weight": 10}, {"weight": 10}]}}, "distinct"),
    "canary step below start": ({"canary": {"weight": 20, "steps": [{"weight": 10}]}}, "rise above canary.weight"),
    "canary override k": ({"canary": {"overrides": {"speculation": {"kMin": 6, "kMax": 2}}}}, "kMin must not exceed"),
    "metric without bound": ({"canary": {"analysis": {"metrics": [{"name": "alpha"}]}}}, "needs min or max"),
    "redis both": ({"redis": {"url": "redis://r", "secretRef": {"name": "s"}}}, "exactly one of redis.url"),
    "canary weight with three decimals": ({"canary": {"weight": 1.234}}, "canary.weight must be a percentage with"),
    "canary step with three decimals": ({"canary": {"weight": 1, "steps": [{"weight": 5.555}]}},
                                        "canary.steps weights must be percentages with at most two decimals"),
    "canary steps below a fractional start": ({"canary": {"weight": 0.5, "steps": [{"weight": 0.25}]}},
                                              "rise above canary.weight"),
    "route for an unknown prompt type": ({"routing": {"byPromptType": {"poetry": "ngram"}}},
                                         "routing.byPromptType keys must be prompt types"),
    "tree rank past branching": ({"speculation": {"tree": {"branching": 2, "choices": [[0], [1], [2]]}}},
                                 "is not below speculation.tree.branching"),
    "tree path past depth": ({"speculation": {"tree": {"branching": 2, "depth": 1, "choices": [[0], [0, 0]]}}},
                             "longer than speculation.tree.depth"),
    "tree path twice": ({"speculation": {"tree": {"branching": 2, "choices": [[0], [1], [0]]}}}, "listed twice"),
    "tree path deeper than kMax": ({"speculation": {"kInitial": 2, "kMax": 2, "tree": {
        "branching": 1, "choices": [[0], [0, 0], [0, 0, 0]]}}}, "deeper than speculation.kMax"),
    "canary tree rank past branching": ({"canary": {"overrides": {"speculation": {"tree": {
        "branching": 1, "choices": [[0], [1]]}}}}}, "is not below speculation.tree.branching"),
    "canary tree path past depth": ({"canary": {"overrides": {"speculation": {"tree": {
        "depth": 2, "choices": [[0], [0, 0], [0, 0, 0]]}}}}}, "longer than speculation.tree.depth"),
    "canary tree path twice": ({"canary": {"overrides": {"speculation": {"tree": {"choices": [[0], [0]]}}}}},
                               "listed twice"),
    "slo window of 0s": ({"slo": {"window": "0s"}}, "slo.window must be longer than 0"),
    "slo window of 0m0ms": ({"slo": {"window": "0m00ms"}}, "slo.window must be longer than 0"),
    "no probes while fallback is enabled": ({"slo": {"fallback": {"probeShare": 0}}},
                                            "slo.fallback.probeShare must be above 0 while fallback is enabled"),
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
    assert specs.rejection_reason(problems) == "InvalidSpec"


_NOT_SERVED = "is not supported yet; supported: "
#: Values the API reserves: the API server rejects each (CEL, the same words as specfleet_api's
#: not_served) and so does the operator, reason Unsupported, for objects that got past CEL.
UNSUPPORTED = {
    "fp8": ({"quantization": "fp8"}, "spec.quantization",
            enums.not_served("quantization", "fp8", enums.SERVED_QUANTIZATIONS)),
    "fp4": ({"quantization": "fp4"}, "spec.quantization",
            enums.not_served("quantization", "fp4", enums.SERVED_QUANTIZATIONS)),
    "float16": ({"dtype": "float16"}, "spec.dtype", enums.not_served("dtype", "float16", enums.SERVED_DTYPES)),
    "canary fp8": ({"canary": {"overrides": {"quantization": "fp8"}}}, "spec.canary.overrides.quantization",
                   enums.not_served("quantization", "fp8", enums.SERVED_QUANTIZATIONS)),
    "canary float16": ({"canary": {"overrides": {"dtype": "float16"}}}, "spec.canary.overrides.dtype",
                       enums.not_served("dtype", "float16", enums.SERVED_DTYPES)),
}


@pytest.mark.parametrize("case", UNSUPPORTED, ids=list(UNSUPPORTED))
def test_reserved_values_are_rejected_as_not_supported_yet_by_cel_and_operator(case):
    over, field, message = UNSUPPORTED[case]
    doc = _with(over)
    validate_openapi(doc)  # the enums reserve them: only CEL rejects them
    assert message in cel_failures(doc)
    problems = specs.problems(doc["spec"])
    assert specs.Problem(field, message, specs.UNSUPPORTED) in problems, problems
    assert specs.rejection_reason(problems) == specs.UNSUPPORTED


def test_medusa_is_served_in_the_spec_the_routes_and_the_canary():
    """No draft method is reserved any more: medusa passes the schema, CEL and the operator as the
    spec's method, as a route and as the canary's method."""
    doc = _with({"draft": {"method": "medusa", "uri": "/models/llama-3.1-8b-medusa"},
                 "routing": {"default": "medusa", "byPromptType": {"code": "ngram", "chat": "medusa"}},
                 "canary": {"overrides": {"draft": {"method": "medusa", "uri": "/models/other-medusa"}}}})
    validate_openapi(doc)
    assert cel_failures(doc) == [] and specs.problems(doc["spec"]) == []
    # its heads are weights: without draft.uri both refuse it, as for eagle
    doc = _with({"draft": {"method": "medusa"}})
    assert any("draft.uri is required" in f for f in cel_failures(doc))
    assert [p.field for p in specs.problems(doc["spec"])] == ["spec.draft.uri"]


def test_routes_to_a_method_no_worker_serves_are_the_operators_to_reject(monkeypatch):
    """Every method the API names is served today; were one reserved again (eagle here, pretended),
    the operator would hold every route to it at Unsupported, in not_served's words."""
    from specfleet_api import engine_config

    served = tuple(m for m in enums.SERVED_METHODS if m != "eagle")
    monkeypatch.setattr(engine_config, "SERVED_METHODS", served)
    doc = _with({"routing": {"default": "eagle", "byPromptType": {"code": "ngram", "chat": "eagle"}}})
    assert specs.problems(doc["spec"]) == [
        specs.Problem("spec.routing.default", enums.not_served("routing.default", "eagle", served), specs.UNSUPPORTED),
        specs.Problem("spec.routing.byPromptType.chat", enums.not_served("routing.byPromptType.chat", "eagle", served),
                      specs.UNSUPPORTED)]


@pytest.mark.parametrize("over, field, words", [
    ({"model": {"name": "m", "uri": "hf://org/m"}}, "spec.model.uri", "model.uri scheme 'hf' " + _NOT_SERVED),
    ({"model": {"name": "m", "uri": "s3://bucket/m"}}, "spec.model.uri", "model.uri scheme 's3' " + _NOT_SERVED),
    ({"draft": {"method": "draft-model", "uri": "hf://org/d"}}, "spec.draft.uri",
     "draft.uri scheme 'hf' " + _NOT_SERVED),
    ({"model": {"name": "m", "uri": "u", "tokenizer": "hf://org/t"}}, "spec.model.tokenizer",
     "model.tokenizer 'hf://org/t' is not supported yet"),
])
def test_uris_and_tokenizers_not_served_are_the_operators_to_reject(over, field, words):
    """Free-form strings: the API server takes them, the operator holds the resource at
    Ready=False (Unsupported) before any worker is created (the e2e test shows that part)."""
    doc = _with(over)
    assert cel_failures(doc) == []
    (problem,) = specs.problems(doc["spec"])
    assert problem.field == field and problem.message.startswith(words) and problem.reason == specs.UNSUPPORTED


def _enum_nodes(node, path="spec"):
    if "enum" in node:
        yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from _enum_nodes(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _enum_nodes(node[key], f"{path}{'[]' if key == 'items' else '{}'}")


#: Every enum in the spec that crosses into the worker, with the specfleet_api tuples it must equal
#: and the engine.json field its not-supported message names.
API_ENUMS = {
    "spec.draft.method": (enums.METHODS, enums.SERVED_METHODS, "draft.method"),
    "spec.routing.default": (enums.METHODS, enums.SERVED_METHODS, "routing.default"),
    "spec.routing.byPromptType{}": (enums.METHODS, enums.SERVED_METHODS, "routing.byPromptType"),
    "spec.canary.overrides.draft.method": (enums.METHODS, enums.SERVED_METHODS, "draft.method"),
    "spec.speculation.kPolicy": (enums.K_POLICIES, enums.SERVED_K_POLICIES, "speculation.kPolicy"),
    "spec.canary.overrides.speculation.kPolicy": (enums.K_POLICIES, enums.SERVED_K_POLICIES, "speculation.kPolicy"),
    "spec.quantization": (enums.QUANTIZATIONS, enums.SERVED_QUANTIZATIONS, "quantization"),
    "spec.dtype": (enums.DTYPES, enums.SERVED_DTYPES, "dtype"),
    "spec.canary.overrides.quantization": (enums.QUANTIZATIONS, enums.SERVED_QUANTIZATIONS, "quantization"),
    "spec.canary.overrides.dtype": (enums.DTYPES, enums.SERVED_DTYPES, "dtype"),
    "spec.device": (enums.DEVICES, enums.SERVED_DEVICES, "device"),
}
#: Enums that are Kubernetes' own or the operator's (not a worker's): nothing in specfleet_api.
OTHER_ENUMS = {"spec.template.imagePullPolicy", "spec.template.tolerations[].operator",
               "spec.template.tolerations[].effect", "spec.canary.analysis.metrics[].name",
               "spec.template.topologySpreadConstraints[].whenUnsatisfiable", "spec.router.tolerations[].operator",
               "spec.router.tolerations[].effect", "spec.strategy.type",
               "spec.engine.name", "spec.engine.vllm.eagleMethod"}  # specfleet_api.vllm's (test_vllm_config)


def test_the_crd_enums_are_specfleet_apis():
    found = dict(_enum_nodes(specs.spec_schema()))
    assert set(found) == set(API_ENUMS) | OTHER_ENUMS, "a new enum: add it to specfleet_api and API_ENUMS"
    for path, (known, served, word) in API_ENUMS.items():
        node = found[path]
        assert tuple(node["enum"]) == known, path
        for value in known:  # CEL lets exactly the served values through, in not_served's words
            verdicts = cel_failures(value, node, path)
            assert verdicts == ([] if value in served else [enums.not_served(word, value, served)]), (path, value)
        assert ("Reserved" in node.get("description", "")) == (served != known), f"{path}: say which are reserved"


def _node(path):
    node = specs.spec_schema()
    for key in path.split(".")[1:]:
        node = node["properties"][key]
    return node


@pytest.mark.parametrize("where", ["spec.speculation.tree", "spec.canary.overrides.speculation.tree"])
def test_tree_caps_are_specfleet_apis_bounds_and_default(where):
    branching, depth = _node(f"{where}.branching"), _node(f"{where}.depth")
    assert (branching["minimum"], branching["maximum"]) == (1, enums.TREE_BRANCHING_MAX)
    assert (depth["minimum"], depth["maximum"]) == (0, enums.TREE_DEPTH_MAX)
    assert "x-kubernetes-validations" not in branching and "x-kubernetes-validations" not in depth
    if where == "spec.speculation.tree":  # overrides have no defaults: unset means stable's
        assert (branching["default"], depth["default"]) == (enums.DEFAULT_TREE_BRANCHING, 0)
        assert defaulted(GOOD)["spec"]["speculation"]["tree"] == {"branching": enums.DEFAULT_TREE_BRANCHING,
                                                                   "depth": 0}


@pytest.mark.parametrize("method", enums.SERVED_METHODS)
@pytest.mark.parametrize("branching", range(1, enums.TREE_BRANCHING_MAX + 1))
def test_trees_are_served_for_every_method_up_to_the_caps(method, branching):
    """Every branching cap within the bounds passes CEL and the operator, in the spec and in the
    canary's overrides, whatever the method; the schema alone refuses one past the bounds."""
    draft = {"method": method, **({"uri": "gguf://d.gguf"} if method in specs.WEIGHTED_METHODS else {})}
    tree = {"branching": branching, "depth": enums.TREE_DEPTH_MAX}
    doc = _with({"draft": draft, "speculation": {"tree": tree},
                 "canary": {"overrides": {"speculation": {"tree": {"branching": branching, "depth": 3}}}}})
    validate_openapi(doc)
    assert cel_failures(doc) == [] and specs.problems(doc["spec"]) == []
    for over in ({"branching": enums.TREE_BRANCHING_MAX + 1}, {"branching": 0}, {"depth": enums.TREE_DEPTH_MAX + 1}):
        with pytest.raises(jsonschema.ValidationError):
            validate_openapi(_with({"draft": draft, "speculation": {"tree": {**tree, **over}}}))


MEDUSA = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


@pytest.mark.parametrize("where", ["spec.speculation.tree", "spec.canary.overrides.speculation.tree"])
def test_a_tree_shape_is_specfleet_apis_bounds_with_no_default(where):
    from specfleet_api.tree_shape import TREE_CHOICE_LENGTH_MAX, TREE_CHOICE_RANK_MAX, TREE_CHOICES_MAX

    choices = _node(where)["properties"]["choices"]
    path, rank = choices["items"], choices["items"]["items"]
    assert (choices["type"], choices["maxItems"], path["type"], path["minItems"], path["maxItems"]) == \
        ("array", TREE_CHOICES_MAX, "array", 1, TREE_CHOICE_LENGTH_MAX)
    assert (rank["type"], rank["minimum"], rank["maximum"]) == ("integer", 0, TREE_CHOICE_RANK_MAX)
    assert "default" not in choices and "choices" not in defaulted(GOOD)["spec"]["speculation"]["tree"]
    if where == "spec.speculation.tree":  # says what a path means, and that absent is today's adaptive tree
        assert "[0, 2] the third child of" in choices["description"] and "Absent or empty" in choices["description"]


@pytest.mark.parametrize("choices", [
    [[0], [8]], [[0], [-1]], [[0], []], [[0] * 17], [[0]] * 65, [[0], ["1"]], [[0], [True]], [0], [[0.5]], "[[0]]"])
@pytest.mark.parametrize("where", ["spec", "canary"])
def test_the_schema_rejects_a_tree_shape_out_of_bounds_or_of_the_wrong_type(choices, where):
    tree = {"speculation": {"tree": {"branching": 8, "choices": choices}}}
    with pytest.raises(jsonschema.ValidationError):
        validate_openapi(_with(tree if where == "spec" else {"canary": {"overrides": tree}}))


def test_a_medusa_shape_passes_schema_cel_and_operator_in_the_spec_and_the_canary():
    doc = _with({"speculation": {"tree": {"branching": 3, "depth": 3, "choices": MEDUSA}},
                 "canary": {"overrides": {"speculation": {"tree": {"branching": 2, "choices": [[0], [1], [0, 0]]}}}}})
    validate_openapi(doc)
    assert cel_failures(doc) == [] and specs.problems(doc["spec"]) == []
    full = [[r] for r in range(8)] + [[p, r] for p in range(7) for r in range(8)]  # the most the schema allows
    doc = _with({"speculation": {"tree": {"branching": 8, "choices": full}}})
    validate_openapi(doc)
    assert cel_failures(doc) == [] and specs.problems(doc["spec"]) == []


@pytest.mark.parametrize("over, field, message", [
    ({"speculation": {"tree": {"branching": 2, "choices": [[0], [1, 0]]}}}, "spec.speculation.tree.choices",
     "speculation.tree.choices[1] [1, 0]: its prefix [1] is not listed"),
    ({"speculation": {"tree": {"branching": 3, "choices": [[0], [2]]}}}, "spec.speculation.tree.choices",
     "speculation.tree.choices[1] [2]: its sibling [1] is not listed (siblings are tried in rank order)"),
    ({"canary": {"overrides": {"speculation": {"tree": {"branching": 2, "choices": [[0, 0]]}}}}},
     "spec.canary.overrides.speculation.tree.choices", "speculation.tree.choices[0] [0, 0]: its prefix [0] is not listed"),
    # stable's shape under a branching the canary lowers: only their combination is wrong
    ({"speculation": {"tree": {"branching": 3, "choices": MEDUSA}},
      "canary": {"overrides": {"speculation": {"tree": {"branching": 2}}}}}, "spec.canary.overrides",
     "speculation.tree.choices[2] [2]: rank 2 is not below speculation.tree.branching (2) (with the overrides)"),
    # the canary's shape under stable's branching, which CEL cannot see from the overrides
    ({"canary": {"overrides": {"speculation": {"tree": {"choices": [[0], [1]]}}}}},
     "spec.canary.overrides.speculation.tree.choices",
     "speculation.tree.choices[1] [1]: rank 1 is not below speculation.tree.branching (1)"),
])
def test_the_operator_names_a_tree_shape_that_cel_cannot_judge(over, field, message):
    """Prefix-closed and sibling-contiguous are engine_config's to judge (and a shape under the
    caps the canary inherits): the API server takes it, the operator holds it at Ready=False."""
    doc = _with(over)
    validate_openapi(doc)
    assert cel_failures(doc) == []
    assert specs.problems(doc["spec"]) == [specs.Problem(field, message)]


def _closed(paths):
    """`paths` with every proper prefix and every lower sibling added: a valid shape's nodes."""
    out = set()
    for path in paths:
        for n in range(1, len(path) + 1):
            out |= {tuple(path[:n - 1]) + (r,) for r in range(path[n - 1] + 1)}
    return [list(p) for p in sorted(out, key=lambda p: (len(p), p))]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4), min_size=1, max_size=5),
       st.integers(1, 5), st.integers(0, 4), st.booleans(), st.booleans())
def test_cel_and_the_operator_agree_on_a_closed_tree_shape(drawn, branching, depth, twice, canary):
    """A prefix-closed, sibling-contiguous shape breaks only the rules CEL checks (ranks, depth,
    a path twice): CEL and the operator then refuse exactly the same shapes."""
    choices = _closed(drawn) + drawn[:1] * twice
    tree = {"speculation": {"tree": {"branching": branching, "depth": depth, "choices": choices}}}
    doc = _with({"canary": {"overrides": tree}} if canary else tree)
    validate_openapi(doc)
    assert (cel_failures(doc) == []) == (specs.problems(doc["spec"]) == [])


@pytest.mark.parametrize("where", ["spec.speculation.latencyGuard", "spec.canary.overrides.speculation.latencyGuard"])
def test_the_latency_guard_is_a_percentage_with_no_default(where):
    """engine.json's bounds, and no default anywhere: absent means the guard is off."""
    from specfleet_api.engine_config import SLOWDOWN_PERCENT

    guard = _node(where)
    percent = guard["properties"]["maxSlowdownPercent"]
    assert (percent["type"], percent["minimum"], percent["maximum"]) == ("integer", *SLOWDOWN_PERCENT)
    assert "default" not in guard and "default" not in percent
    assert "latencyGuard" not in defaulted(GOOD)["spec"]["speculation"]
    if where == "spec.speculation.latencyGuard":  # says what it trades, and that absent is off
        assert "Absent (the default): no guard" in guard["description"] and "tail latency" in guard["description"]


@pytest.mark.parametrize("percent", [1, 2, 100])
def test_a_latency_guard_within_bounds_passes_schema_cel_and_operator(percent):
    doc = _with({"speculation": {"latencyGuard": {"maxSlowdownPercent": percent}},
                 "canary": {"overrides": {"speculation": {"latencyGuard": {"maxSlowdownPercent": percent}}}}})
    validate_openapi(doc)
    assert cel_failures(doc) == [] and specs.problems(doc["spec"]) == []


@pytest.mark.parametrize("value", [0, 101, -1, "5", True, 2.5, None])
@pytest.mark.parametrize("where", ["spec", "canary"])
def test_the_schema_rejects_a_latency_guard_out_of_bounds_or_not_an_integer(value, where):
    guard = {"latencyGuard": {"maxSlowdownPercent": value}}
    over = {"speculation": guard} if where == "spec" else {"canary": {"overrides": {"speculation": guard}}}
    with pytest.raises(jsonschema.ValidationError):
        validate_openapi(_with(over))


def test_the_operator_names_a_latency_guard_out_of_bounds_that_got_past_the_schema():
    (problem,) = specs.problems(_with({"speculation": {"latencyGuard": {"maxSlowdownPercent": 0}}})["spec"])
    assert problem.field == "spec.speculation.latencyGuard.maxSlowdownPercent" and "between 1 and 100" in problem.message
    (problem,) = specs.problems(_with({"canary": {"overrides": {"speculation": {"latencyGuard": {
        "maxSlowdownPercent": 101}}}}})["spec"])
    assert problem.field == "spec.canary.overrides.speculation.latencyGuard.maxSlowdownPercent"


@pytest.mark.parametrize("where", ["spec.draft.ngram", "spec.canary.overrides.draft.ngram"])
def test_the_ngram_corpus_is_specfleet_apis_bounds_and_default(where):
    tokens = _node(where)["properties"]["corpusTokens"]
    assert (tokens["type"], tokens["minimum"], tokens["maximum"]) == ("integer", 0, enums.NGRAM_CORPUS_TOKENS_MAX)
    if where == "spec.draft.ngram":  # overrides have no defaults: unset means stable's
        assert tokens["default"] == enums.DEFAULT_NGRAM_CORPUS_TOKENS
        assert "ngram" not in defaulted(GOOD)["spec"]["draft"]  # stored objects stay as they were
    else:
        assert "default" not in tokens


@pytest.mark.parametrize("value", [-1, enums.NGRAM_CORPUS_TOKENS_MAX + 1, "16k", True, 1.5])
@pytest.mark.parametrize("where", ["spec", "canary"])
def test_the_schema_rejects_an_ngram_corpus_out_of_bounds_or_not_an_integer(value, where):
    draft = {"draft": {"method": "ngram", "ngram": {"corpusTokens": value}}}
    with pytest.raises(jsonschema.ValidationError):
        validate_openapi(_with(draft if where == "spec" else {"canary": {"overrides": draft}}))
    good = {"draft": {"method": "ngram", "ngram": {"corpusTokens": 16384}}}
    validate_openapi(_with(good if where == "spec" else {"canary": {"overrides": good}}))


def test_the_operator_names_an_ngram_corpus_out_of_bounds_that_got_past_the_schema():
    (problem,) = specs.problems(_with({"draft": {"method": "ngram", "ngram": {"corpusTokens": -1}}})["spec"])
    assert problem.field == "spec.draft.ngram.corpusTokens" and "between 0 and" in problem.message
    (problem,) = specs.problems(_with({"canary": {"overrides": {"draft": {"ngram": {"corpusTokens": 10**7}}}}})["spec"])
    assert problem.field == "spec.canary.overrides.draft.ngram.corpusTokens"


def test_ngram_mix_is_a_boolean_off_by_default_valid_with_a_head_and_its_cel_words_are_the_apis():
    from specfleet_api.engine_config import MIX_METHODS, MIX_PROBLEM

    mix = _node("spec.draft.ngram")["properties"]["mix"]
    assert (mix["type"], mix["default"]) == ("boolean", False)
    assert _node("spec.canary.overrides.draft.ngram")["properties"]["mix"] == {"type": "boolean"}
    (rule,) = [r for r in _node("spec")["x-kubernetes-validations"]
               if "draft.ngram.mix" in r["rule"] and "self.engine" not in r["rule"]]  # not vLLM's refusal
    assert rule["message"] == MIX_PROBLEM and rule["fieldPath"] == ".draft.ngram.mix"
    assert rule["rule"].endswith("self.draft.method in [" + ", ".join(f"'{m}'" for m in MIX_METHODS) + "]")
    for method in MIX_METHODS:
        doc = _with({"draft": {"method": method, "uri": "/heads/h", "ngram": {"mix": True}}})
        validate_openapi(doc)
        assert cel_failures(doc) == [] and specs.problems(doc["spec"]) == []
    with pytest.raises(jsonschema.ValidationError):
        validate_openapi(_with({"draft": {"method": "eagle", "uri": "/h", "ngram": {"mix": "yes"}}}))
    off = _with({"draft": {"method": "ngram", "ngram": {"mix": False}}})
    assert cel_failures(off) == [] and specs.problems(off["spec"]) == []


def test_the_operator_names_a_canary_whose_method_cannot_take_the_stables_mix():
    """CEL sees the spec; the canary's overrides meet the spec only in the operator's judgment."""
    doc = _with({"draft": {"method": "eagle", "uri": "/heads/h", "ngram": {"mix": True}},
                 "canary": {"overrides": {"draft": {"method": "ngram"}}}})
    assert cel_failures(doc) == []
    (problem,) = specs.problems(doc["spec"])
    assert problem.field == "spec.canary.overrides" and "draft.ngram.mix needs draft.method" in problem.message
    doc = _with({"draft": {"method": "eagle", "uri": "/heads/h"},
                 "canary": {"overrides": {"draft": {"ngram": {"mix": True}}}}})
    assert specs.problems(doc["spec"]) == []  # the canary tries the mix on the stable head


def _schema_leaves(node, path=()):
    props = node.get("properties")
    if not props:
        return {path}
    return set().union(*(_schema_leaves(sub, path + (key,)) for key, sub in props.items()))


def test_every_canary_override_has_a_home_in_the_promotion_record():
    """The API server prunes what a structural schema does not list: a promoted override with no
    field in status.canary.promoted would be dropped, and stable would lose it."""
    overrides = _schema_leaves(_node("spec.canary.overrides"))
    promoted = SCHEMA["properties"]["status"]["properties"]["canary"]["properties"]["promoted"]["properties"]
    assert ("speculation", "latencyGuard", "maxSlowdownPercent") in overrides
    assert ("speculation", "tree", "choices") in overrides
    assert _schema_leaves(promoted["overrides"]) == overrides
    assert _schema_leaves(promoted["base"]) == overrides


def test_device_defaults_to_auto_and_every_device_is_served():
    assert defaulted(GOOD)["spec"]["device"] == enums.Device.AUTO
    doc = _with({"device": "cuda"})
    assert cel_failures(doc) == [] and specs.problems(doc["spec"]) == []
    with pytest.raises(jsonschema.ValidationError):
        validate_openapi(_with({"device": "tpu"}))


@pytest.mark.parametrize("over", [
    {"draft": {"method": "magic"}}, {"quantization": "int3"}, {"canary": {"weight": 101}},
    {"canary": {"weight": 0}}, {"canary": {"weight": 0.001}}, {"canary": {"weight": "1%"}},
    {"canary": {"replicas": 0}}, {"canary": {"steps": [{"weight": 0}]}}, {"router": {"replicas": 0}},
    {"speculation": {"kMax": 99}}, {"slo": {"window": "five minutes"}}, {"model": {"name": "m"}},
    {"canary": {"progressDeadline": "ten minutes"}}, {"canary": {"pause": "5"}},
    {"canary": {"analysis": {"minRequests": 0}}}, {"canary": {"analysis": {"compare": {"alpha": -0.1}}}},
    {"canary": {"analysis": {"compare": {"errorRate": 2}}}}, {"canary": {"analysis": {"drift": {"threshold": 1.5}}}},
    {"canary": {"analysis": {"drift": {"sampleShare": 101}}}}, {"canary": {"analysis": {"drift": {"minPairs": 0}}}},
    {"canary": {"analysis": {"metrics": [{"name": "latency", "max": 1}]}}},
    {"canary": {"overrides": {"quantization": "int3"}}},
])
def test_schema_rejects_enums_ranges_and_required(over):
    doc = copy.deepcopy(GOOD)
    doc["spec"].update(over)
    with pytest.raises(jsonschema.ValidationError):
        validate_openapi(doc)


# 0.01 to 100 in thousandths: schema-valid weights, a tenth of them with a third decimal
weights = st.integers(10, 100_000).map(lambda n: n / 1000)
spec_strategy = st.fixed_dictionaries({
    "method": st.sampled_from(enums.METHODS), "uri": st.booleans(),
    "quantization": st.sampled_from(enums.QUANTIZATIONS), "dtype": st.sampled_from(enums.DTYPES),
    "device": st.sampled_from(enums.DEVICES),
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
         "speculation": dict(zip(("kMin", "kInitial", "kMax"), drawn["k"]), tree={"branching": drawn["branching"]}),
         "quantization": drawn["quantization"], "dtype": drawn["dtype"], "device": drawn["device"]}
    if drawn["uri"]:
        s["draft"]["uri"] = "gguf://d.gguf"  # a served scheme: only the operator judges URIs
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


def _weight_node():
    return specs.spec_schema()["properties"]["canary"]["properties"]["weight"]


@pytest.mark.parametrize("weight, ok", [
    (1, True), (0.01, True), (0.07, True), (0.29, True), (12.5, True), (33.33, True), (99.99, True), (100, True),
    (0.011, False), (1.005, False), (12.345, False), (99.999, False), (0.015, False),
])
def test_a_canary_weight_is_a_request_share_with_two_decimals(weight, ok):
    """0.07 and 0.29 are 7.000000000000001 and 28.999999999999996 in hundredths: CEL's rule and
    the operator's check must both accept them, and both refuse a third decimal."""
    node = _weight_node()
    validate_openapi({**GOOD, "spec": {**GOOD["spec"], "canary": {"weight": weight}}})
    assert (cel_failures(weight, node, "spec.canary.weight") == []) == ok
    assert specs.is_percentage(weight) == ok
    step = specs.spec_schema()["properties"]["canary"]["properties"]["steps"]["items"]
    assert (cel_failures({"weight": weight}, step, "spec.canary.steps[0]") == []) == ok
    doc = _with({"canary": {"weight": weight}})
    assert (specs.problems(doc["spec"]) == []) == ok


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 10_000), st.integers(0, 9))
def test_every_two_decimal_weight_passes_and_every_third_decimal_fails(hundredths, thousandth):
    weight = hundredths / 100 if thousandth == 0 else (hundredths * 10 + thousandth) / 1000
    if weight > 100:
        return
    node = _weight_node()
    assert (cel_failures(weight, node, "spec.canary.weight") == []) == (thousandth == 0)
    assert specs.is_percentage(weight) == (thousandth == 0)


def test_canary_replicas_default_to_one_and_the_weight_means_requests():
    canary = specs.spec_schema()["properties"]["canary"]["properties"]
    assert canary["replicas"]["default"] == 1 and canary["weight"]["type"] == "number"
    assert "requests" in canary["weight"]["description"]
    assert defaulted({**GOOD, "spec": {**GOOD["spec"], "canary": {}}})["spec"]["canary"]["replicas"] == 1


def test_routing_keys_are_the_routers_prompt_types():
    node = specs.spec_schema()["properties"]["routing"]["properties"]["byPromptType"]
    (rule,) = node["x-kubernetes-validations"]
    assert rule["message"] == f"routing.byPromptType keys must be prompt types: {', '.join(enums.PROMPT_TYPES)}"
    assert cel_failures({t: "ngram" for t in enums.PROMPT_TYPES}, node) == []
    assert cel_failures({"chat": "ngram", "poetry": "none"}, node) == [rule["message"]]


def test_canary_defaults_are_the_canary_policys():
    """The CRD's defaults and specfleet_control.canary's are one set of numbers."""
    from specfleet_control import canary

    spec = defaulted({**GOOD, "spec": {**GOOD["spec"], "canary": {}}})["spec"]
    c = spec["canary"]
    assert (c["pause"], c["progressDeadline"]) == ("5m", "10m")
    assert set(c["analysis"]["compare"]) == {"alpha", "tau", "speedup", "ttftP50", "ttftP99", "tpotP50", "tpotP99",
                                             "errorRate"}
    p = canary.CanaryPolicy.from_spec(spec)
    assert p.compare == canary.Compare() and p.drift == canary.DriftPolicy()
    assert (p.pause_s, p.progress_deadline_s, p.interval_s, p.failure_limit, p.min_requests) == \
        (canary.CanaryPolicy.pause_s, canary.CanaryPolicy.progress_deadline_s, canary.CanaryPolicy.interval_s,
         canary.CanaryPolicy.failure_limit, canary.CanaryPolicy.min_requests)
    assert "threshold" not in c["analysis"]["drift"]  # its default depends on the two arms' precision
    node = SCHEMA["properties"]["spec"]["properties"]["canary"]["properties"]["analysis"]["properties"]
    assert node["metrics"]["items"]["properties"]["name"]["enum"] == list(canary.METRICS)
    phases = SCHEMA["properties"]["status"]["properties"]["canary"]["properties"]["phase"]["enum"]
    assert tuple(phases) == canary.PHASES


@pytest.mark.parametrize("field, value", [("pause", "5 minutes"), ("progressDeadline", "1d")])
def test_canary_durations_are_checked_by_the_operator_too(field, value):
    doc = _with({"canary": {field: value}})
    (problem,) = specs.problems(doc["spec"])
    assert problem.field == f"spec.canary.{field}" and repr(value) in problem.message


def test_a_canary_status_section_validates():
    """What specfleet_control.canary writes to status.canary passes the CRD's status schema."""
    from specfleet_control import canary

    state = canary.CanaryState("Promoted", 2, 0.0, started=1.0e9, last_analysis=1.0e9 + 60, epoch="e", config_hash="h",
                               last_gate="promote", message="m", promoted={
                                   "overrides": {"speculation": {"kMax": 12}, "image": "w:2", "quantization": "int8"},
                                   "base": {"speculation": {"kMax": 8}}, "at": "2026-01-01T00:00:00Z",
                                   "configHash": "h"})
    validate_openapi({**GOOD, "status": {"canary": state.to_status()}})
    with pytest.raises(jsonschema.ValidationError):
        validate_openapi({**GOOD, "status": {"canary": {"phase": "Rolling"}}})


def test_a_canary_kmax_under_the_stable_shapes_depth_is_the_operators_to_reject():
    # CEL sees the overrides alone; the operator judges the canary's engine.json, shape and kMax together
    doc = _with({"speculation": {"tree": {"branching": 2, "choices": [[0], [1], [0, 0], [0, 0, 0]]}},
                 "canary": {"weight": 1, "overrides": {"speculation": {"kMin": 0, "kInitial": 2, "kMax": 2}}}})
    assert cel_failures(doc) == []
    problems = specs.problems(doc["spec"])
    assert [(p.field, "deeper than speculation.kMax (2)" in p.message, "(with the overrides)" in p.message)
            for p in problems] == [("spec.canary.overrides", True, True)], problems


SOURCE_BAD = {
    "two sources": ({"pvc": {"claimName": "w"}, "volume": {"csi": {"driver": "d"}}}, "spec.model.source",
                    "set exactly one of model.source.pvc, model.source.initContainer and model.source.volume"),
    "no source": ({}, "spec.model.source",
                  "set exactly one of model.source.pvc, model.source.initContainer and model.source.volume"),
    "subPath up": ({"pvc": {"claimName": "w", "subPath": "a/../../etc"}}, "spec.model.source.pvc.subPath",
                   "model.source.pvc.subPath must be a relative path without '..'"),
    "subPath absolute": ({"pvc": {"claimName": "w", "subPath": "/etc"}}, "spec.model.source.pvc.subPath",
                         "model.source.pvc.subPath must be a relative path without '..'"),
    "volume of no kind": ({"volume": {}}, "spec.model.source.volume",
                          "model.source.volume: set exactly one of persistentVolumeClaim, csi, ephemeral, configMap,"
                          " secret and projected"),
    "volume of two kinds": ({"volume": {"csi": {"driver": "d"}, "secret": {"secretName": "s"}}},
                            "spec.model.source.volume",
                            "model.source.volume: set exactly one of persistentVolumeClaim, csi, ephemeral, "
                            "configMap, secret and projected"),
}


@pytest.mark.parametrize("case", SOURCE_BAD, ids=list(SOURCE_BAD))
def test_a_model_source_is_one_source_and_cel_and_the_operator_agree(case):
    source, field, message = SOURCE_BAD[case]
    doc = _with({"model": {"name": "m", "uri": "m.gguf", "source": source}})
    validate_openapi(doc)
    assert message in cel_failures(doc)
    assert specs.Problem(field, message) in specs.problems(doc["spec"])


@pytest.mark.parametrize("source", [
    {"pvc": {"claimName": "w", "subPath": "models/qwen"}},
    {"initContainer": {"image": "copier:1", "args": ["s3://b/m", "/var/cache/specfleet/m"],
                       "secretRef": {"name": "s3"}}},
    {"volume": {"persistentVolumeClaim": {"claimName": "w", "readOnly": True}}},
])
def test_a_model_source_passes_schema_cel_and_operator_and_defaults_to_read_only(source):
    for uri in ("m.gguf", "file://qwen/model.gguf", "gguf:///var/cache/specfleet/m.gguf"):
        doc = _with({"model": {"name": "m", "uri": uri, "source": source}})
        validate_openapi(doc)
        assert cel_failures(doc) == [] and specs.problems(doc["spec"]) == []
    if "pvc" in source:
        assert doc["spec"]["model"]["source"]["pvc"]["readOnly"] is True


def test_with_a_model_source_the_operator_names_a_uri_outside_the_mount():
    doc = _with({"model": {"name": "m", "uri": "/models/m.gguf", "source": {"pvc": {"claimName": "w"}}}})
    (problem,) = specs.problems(doc["spec"])
    assert problem.field == "spec.model.uri" and "mounted at /var/cache/specfleet" in problem.message


def test_the_schema_keeps_a_model_source_to_its_fields():
    for source in ({"pvc": {}}, {"initContainer": {"args": ["x"]}}, {"pvc": {"claimName": "w", "readOnly": "yes"}}):
        doc = copy.deepcopy(GOOD)
        doc["spec"]["model"]["source"] = source
        with pytest.raises(jsonschema.ValidationError):
            validate_openapi(doc)


@pytest.mark.parametrize("resources, ok", [
    ({"limits": {"nvidia.com/gpu": 1}, "requests": {"nvidia.com/gpu": 1}}, True),
    ({"limits": {"nvidia.com/gpu": 2}, "requests": {"nvidia.com/gpu": "2"}}, True),
    ({"limits": {"nvidia.com/gpu": 1}}, True),
    ({"requests": {"cpu": "1"}, "limits": {"memory": "8Gi"}}, True),
    ({"limits": {"nvidia.com/gpu": 2}, "requests": {"nvidia.com/gpu": 1}}, False),
    ({"requests": {"nvidia.com/gpu": 1}}, False),
])
def test_a_gpu_request_must_equal_its_limit(resources, ok):
    doc = _with({"template": {"resources": resources}})
    validate_openapi(doc)
    message = "template.resources.requests nvidia.com/gpu must equal limits nvidia.com/gpu"
    assert any(message in f for f in cel_failures(doc)) != ok
    assert (specs.Problem("spec.template.resources", f"{message} (GPUs are not overcommitted)")
            in specs.problems(doc["spec"])) != ok


def test_pod_fields_pass_schema_and_cel():
    doc = _with({"template": {"runtimeClassName": "nvidia", "imagePullSecrets": [{"name": "r"}],
                              "affinity": {"podAntiAffinity": {}},
                              "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                                             "whenUnsatisfiable": "DoNotSchedule"}]},
                 "router": {"imagePullSecrets": [{"name": "r"}], "nodeSelector": {"pool": "cpu"},
                            "tolerations": [{"key": "k", "operator": "Exists"}]}})
    validate_openapi(doc)
    assert cel_failures(doc) == [] and specs.problems(doc["spec"]) == []
    for bad in ({"imagePullSecrets": [{}]}, {"topologySpreadConstraints": [{"maxSkew": 0, "topologyKey": "z",
                                                                            "whenUnsatisfiable": "DoNotSchedule"}]}):
        with pytest.raises(jsonschema.ValidationError):
            validate_openapi(_with({"template": bad}))


@pytest.mark.parametrize("strategy, message", [
    ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}, None),
    ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "0%", "maxUnavailable": "25%"}}, None),
    ({"type": "RollingUpdate"}, None),
    ({"type": "Recreate"}, None),
    ({"type": "Recreate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
     "strategy.rollingUpdate is for strategy.type RollingUpdate only"),
    ({"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": "0%"}},
     "strategy.rollingUpdate.maxSurge and maxUnavailable cannot both be 0 (the rollout could never move)"),
])
def test_a_rollout_strategy_that_cannot_move_is_refused_by_cel_and_operator(strategy, message):
    doc = _with({"strategy": strategy})
    validate_openapi(doc)
    assert cel_failures(doc) == ([message] if message else [])
    assert specs.problems(doc["spec"]) == ([specs.Problem("spec.strategy.rollingUpdate", message)] if message else [])


@pytest.mark.parametrize("strategy", [{"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                                      {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1}},
                                      {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": -1, "maxUnavailable": 1}},
                                      {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "1", "maxUnavailable": 1}},
                                      {"type": "BlueGreen"}])
def test_the_schema_keeps_a_strategy_to_a_deployments(strategy):
    doc = copy.deepcopy(GOOD)
    doc["spec"]["strategy"] = strategy
    with pytest.raises(jsonschema.ValidationError):
        validate_openapi(doc)


@pytest.mark.parametrize("slo", [{"window": "10s"}, {"window": "0m30s"}, {"window": "100ms"},
                                 {"fallback": {"enabled": False, "probeShare": 0}}, {"fallback": {"probeShare": 0.5}}])
def test_short_windows_and_small_or_unneeded_probe_shares_are_accepted(slo):
    doc = _with({"slo": slo})
    validate_openapi(doc)
    assert cel_failures(doc) == [] and specs.problems(doc["spec"]) == []


def _doc_specs():
    for name in ("gpu.md", "weights.md"):
        for block in re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / name).read_text(), re.S):
            found = yaml.safe_load(block)
            # a whole resource, a spec, or a model.source fragment
            spec = found["spec"] if "spec" in found else {"model": {"name": "m", "uri": "m.gguf", **found}}
            yield pytest.param({"replicas": 1, **spec}, id=f"{name}:{next(iter(found))}")


@pytest.mark.parametrize("spec", _doc_specs())
def test_the_gpu_and_weights_docs_examples_are_accepted_and_render_valid_pods(spec):
    from specfleet_operator import manifests
    doc = defaulted({**GOOD, "spec": spec})
    validate_openapi(doc)
    assert cel_failures(doc) == [] and specs.problems(doc["spec"]) == []
    d = manifests.deployment({"metadata": {"name": "x", "namespace": "ml"}}, doc["spec"], "stable", manifests.Settings())
    kubernetes_validate.validate(d, "1.30", strict=True)


pod_strategy = st.fixed_dictionaries({
    "source": st.sampled_from([None, "pvc", "volume", "both", "neither", "subPath up", "outside"]),
    "rolling": st.none() | st.tuples(st.sampled_from([0, 1, "0%", "25%"]), st.sampled_from([0, 1, "0%", "25%"])),
    "recreate": st.booleans(),
    "window": st.sampled_from(["5m", "0s", "30s", "0m0s"]),
    "probe": st.tuples(st.booleans(), st.sampled_from([0, 0.5, 5])),
    "gpus": st.none() | st.tuples(st.integers(1, 2), st.integers(1, 2)),
})


@settings(max_examples=150, deadline=None)
@given(pod_strategy)
def test_operator_checks_agree_with_cel_on_weights_gpus_rollouts_and_the_slo(drawn):
    """Drawn over an otherwise good spec, so that one broken field decides the verdict."""
    s = copy.deepcopy(GOOD["spec"])
    sources = {"pvc": {"pvc": {"claimName": "w"}}, "volume": {"volume": {"csi": {"driver": "d"}}},
               "both": {"pvc": {"claimName": "w"}, "volume": {"csi": {"driver": "d"}}}, "neither": {},
               "subPath up": {"pvc": {"claimName": "w", "subPath": "w/../.."}}, "outside": {"pvc": {"claimName": "w"}}}
    if drawn["source"]:
        s["model"]["source"] = sources[drawn["source"]]
    outside = drawn["source"] == "outside"  # the operator's own check: a path CEL cannot judge against the mount
    if outside:
        s["model"]["uri"] = "/models/m.gguf"
    if drawn["rolling"]:
        s["strategy"] = {"type": "Recreate" if drawn["recreate"] else "RollingUpdate",
                         "rollingUpdate": dict(zip(("maxSurge", "maxUnavailable"), drawn["rolling"]))}
    s["slo"] = {"window": drawn["window"], "fallback": dict(zip(("enabled", "probeShare"), drawn["probe"]))}
    if drawn["gpus"]:
        s["template"] = {"resources": {"limits": {"nvidia.com/gpu": drawn["gpus"][0]},
                                       "requests": {"nvidia.com/gpu": drawn["gpus"][1]}}}
    doc = defaulted({**GOOD, "spec": s})
    validate_openapi(doc)
    cel, operator = cel_failures(doc), specs.problems(doc["spec"])
    assert len(cel) == len(operator) - outside, (cel, operator)
    assert {p.message for p in operator} >= set(cel)


# spec.redis.url -> whether it holds a password (which would be a plain value in every pod template)
REDIS_URLS = {
    "redis://:s3cret@r:6379/0": True, "rediss://app:s3cret@r.example.com:6380/0": True,
    "redis://app:s3cret@[::1]:6379": True, "redis://app:p@s3cret@r": True, "redis://app:@r": True,
    "redis://r:6379/0?password=s3cret": True, "rediss://r/0?db=1&password=s3cret": True,
    "redis://r:6379/0": False, "rediss://r.example.com:6380/0": False, "redis://app@r:6379/0": False,
    "redis://[::1]:6379/0": False, "redis://app@[::1]:6379": False, "redis://r/0?db=1": False,
}


@pytest.mark.parametrize("url, has_password", REDIS_URLS.items())
def test_a_redis_url_with_a_password_is_refused_by_cel_and_operator_never_echoed(url, has_password):
    from redis.connection import parse_url

    # what the pods' client would log in with; an empty password (`app:@`) is refused as well
    assert has_password == ("password" in parse_url(url) or ":@" in url)
    doc = _with({"redis": {"url": url}})
    validate_openapi(doc)  # the scheme pattern lets them all through: only CEL can refuse them
    cel, problems = cel_failures(doc), specs.problems(doc["spec"])
    if not has_password:
        assert cel == [] and problems == []
        return
    assert cel == [specs.REDIS_URL_PASSWORD_MESSAGE]
    assert [p.field for p in problems] == ["spec.redis.url"] and specs.rejection_reason(problems) == "InvalidSpec"
    (problem,) = problems
    assert problem.message == specs.REDIS_URL_PASSWORD_MESSAGE
    assert "spec.redis.secretRef" in problem.message and "default Redis" in problem.message
    assert "s3cret" not in str(problem)


def test_the_redis_url_cel_rule_is_the_operators_regex():
    node = specs.spec_schema()["properties"]["redis"]["properties"]["url"]
    (rule,) = node["x-kubernetes-validations"]
    assert rule == {"rule": f"!self.matches('{specs.REDIS_URL_WITH_PASSWORD}')",
                    "message": specs.REDIS_URL_PASSWORD_MESSAGE}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["redis", "rediss"]), st.sampled_from(["", "app", "a.b-c"]),
       st.sampled_from([None, "", "s3cret", "p@ss", "p:ss", "p%40ss"]),
       st.sampled_from(["r", "r.example.com", "10.0.0.1", "[::1]", "[fe80::1]"]), st.sampled_from(["", ":6379"]),
       st.sampled_from(["", "/", "/0"]), st.sampled_from(["", "db=1", "password=s3cret", "db=1&password=x", "username=u"]))
def test_cel_and_operator_refuse_exactly_the_urls_that_carry_a_password(scheme, user, password, host, port, path,
                                                                          query):
    """The oracle is how the pods' client reads a URL: urllib's user info, and redis-py's query options."""
    from urllib.parse import parse_qs, urlsplit

    userinfo = "" if password is None and not user else user + ("" if password is None else f":{password}") + "@"
    url = f"{scheme}://{userinfo}{host}{port}{path}" + (f"?{query}" if query else "")
    carries = urlsplit(url).password is not None or "password" in parse_qs(urlsplit(url).query)
    doc = _with({"redis": {"url": url}})
    assert (cel_failures(doc) != []) == carries == specs.url_has_password(url), url
    assert (specs.problems(doc["spec"]) != []) == carries, url


# engine vllm: what a vLLM server cannot do, refused by CEL and by the operator in the same words
# (specfleet_api.vllm), named by the field that asked for it.
from specfleet_api import vllm as vllm_api  # noqa: E402

VLLM = {"engine": {"name": "vllm"}, "model": {"name": "m", "uri": "/models/m"},
        "speculation": {"kPolicy": "fixed", "kInitial": 4, "kMax": 4}}
_STATIC4 = {"kPolicy": "fixed", "kInitial": 4, "kMax": 4}
VLLM_REFUSED = {
    "adaptive K": ({"speculation": {**_STATIC4, "kPolicy": "adaptive"}}, "spec.speculation.kPolicy", vllm_api.K_POLICY),
    "canary entropy K": ({"canary": {"overrides": {"speculation": {"kPolicy": "entropy"}}}},
                         "spec.canary.overrides.speculation.kPolicy", vllm_api.K_POLICY),
    "kInitial below kMax": ({"speculation": {**_STATIC4, "kInitial": 2}}, "spec.speculation.kMax", vllm_api.K_STATIC),
    "K of 0": ({"speculation": {"kPolicy": "fixed", "kMin": 0, "kInitial": 0, "kMax": 0}}, "spec.speculation.kMax",
               vllm_api.K_STATIC),
    "canary kMax alone": ({"canary": {"overrides": {"speculation": {"kMax": 6}}}},
                          "spec.canary.overrides.speculation.kMax", vllm_api.K_STATIC),
    "tree branching": ({"speculation": {**_STATIC4, "tree": {"branching": 2}}}, "spec.speculation.tree", vllm_api.TREE),
    "tree depth": ({"speculation": {**_STATIC4, "tree": {"depth": 3}}}, "spec.speculation.tree", vllm_api.TREE),
    "tree shape": ({"speculation": {**_STATIC4, "tree": {"choices": [[0], [0, 0]]}}}, "spec.speculation.tree",
                   vllm_api.TREE),
    "canary tree": ({"canary": {"overrides": {"speculation": {"tree": {"branching": 1}}}}},
                    "spec.canary.overrides.speculation.tree", vllm_api.TREE),
    "latency guard": ({"speculation": {**_STATIC4, "latencyGuard": {"maxSlowdownPercent": 2}}},
                      "spec.speculation.latencyGuard", vllm_api.LATENCY_GUARD),
    "canary latency guard": ({"canary": {"overrides": {"speculation": {"latencyGuard": {"maxSlowdownPercent": 2}}}}},
                             "spec.canary.overrides.speculation.latencyGuard", vllm_api.LATENCY_GUARD),
    "K ceilings per type": ({"speculation": {**_STATIC4, "kTuning": {"enabled": True}}},
                            "spec.speculation.kTuning.enabled", vllm_api.K_TUNING),
    "ngram corpus": ({"draft": {"method": "ngram", "ngram": {"corpusTokens": 1024}}}, "spec.draft.ngram",
                     vllm_api.NGRAM),
    "ngram mix": ({"draft": {"method": "eagle", "uri": "/heads/e", "ngram": {"mix": True}}}, "spec.draft.ngram",
                  vllm_api.NGRAM),
    "canary ngram": ({"canary": {"overrides": {"draft": {"ngram": {"corpusTokens": 0}}}}},
                     "spec.canary.overrides.draft.ngram", vllm_api.NGRAM),
    "int8": ({"quantization": "int8"}, "spec.quantization", vllm_api.QUANTIZATION),
    "canary int8": ({"canary": {"overrides": {"quantization": "int8"}}}, "spec.canary.overrides.quantization",
                    vllm_api.QUANTIZATION),
    "autoscaling": ({"replicas": None, "scaling": {"maxReplicas": 3}}, "spec.scaling", vllm_api.SCALING),
    "worker image": ({"template": {"image": "w:1"}}, "spec.template.image", vllm_api.IMAGE),
    "canary worker image": ({"canary": {"overrides": {"image": "w:2"}}}, "spec.canary.overrides.image", vllm_api.IMAGE),
    "a route to weights the arm lacks": ({"routing": {"byPromptType": {"chat": "eagle"}}}, "spec.routing",
                                         vllm_api.ROUTES),
    "a default to weights the arm lacks": ({"routing": {"default": "medusa"}}, "spec.routing", vllm_api.ROUTES),
    "the canary's method drops a routed one": (
        {"draft": {"method": "medusa", "uri": "/heads/m"}, "routing": {"byPromptType": {"code": "medusa"}},
         "canary": {"overrides": {"draft": {"method": "eagle", "uri": "/heads/e"}}}},
        "spec.canary.overrides.draft.method", vllm_api.ROUTES),
    "gguf target": ({"model": {"name": "m", "uri": "gguf:///models/m.gguf"}}, "spec.model.uri", vllm_api.GGUF),
    "relative target without a source": ({"model": {"name": "m", "uri": "llama"}}, "spec.model.uri",
                                         vllm_api.MODEL_PATH),
    "relative draft": ({"draft": {"method": "draft-model", "uri": "small"}}, "spec.draft.uri", vllm_api.DRAFT_URI),
    "gguf draft": ({"draft": {"method": "draft-model", "uri": "/models/small.gguf"}}, "spec.draft.uri",
                   vllm_api.DRAFT_URI),
    "relative canary draft": ({"canary": {"overrides": {"draft": {"method": "eagle", "uri": "head"}}}},
                              "spec.canary.overrides.draft.uri", vllm_api.DRAFT_URI),
    "vllm settings for specfleet": ({"engine": {"name": "specfleet", "vllm": {}}}, "spec.engine.vllm",
                                    vllm_api.ENGINE_VLLM),
    "lookup out of order": ({"engine": {"name": "vllm", "vllm": {"ngram": {"promptLookupMin": 5,
                                                                           "promptLookupMax": 3}}}},
                            "spec.engine.vllm.ngram", vllm_api.LOOKUP),
    "a pool of no method": ({"engine": {"name": "vllm", "vllm": {"pools": {"eagle3": {"replicas": 1}}}}},
                            "spec.engine.vllm.pools", vllm_api.POOL_KEYS),
    "an owned flag": ({"engine": {"name": "vllm", "vllm": {"args": ["--seed", "1", "--specul", "{}"]}}},
                      "spec.engine.vllm.args[2]", vllm_api.ARGS),
}


def _vllm(over):
    return _with({**VLLM, **over})


@pytest.mark.parametrize("case", VLLM_REFUSED, ids=list(VLLM_REFUSED))
def test_what_vllm_cannot_do_is_refused_by_cel_and_operator_naming_the_field(case):
    over, field, message = VLLM_REFUSED[case]
    doc = _vllm(over)
    validate_openapi(doc)  # only CEL (and the operator) can catch these
    assert message in cel_failures(doc)
    problems = specs.problems(doc["spec"])
    assert specs.Problem(field, message) in problems, problems
    assert specs.rejection_reason(problems) == "InvalidSpec"
    # the same spec on specfleet's own workers is not refused for this
    if field != "spec.engine.vllm":
        theirs = _with({k: v for k, v in {**VLLM, **over}.items() if k != "engine"})
        assert message not in cel_failures(theirs)


@pytest.mark.parametrize("over", [
    {}, {"model": {"name": "m", "uri": "llama", "source": {"pvc": {"claimName": "w"}}}},
    {"model": {"name": "m", "uri": "file:///models/m"}},
    {"draft": {"method": "eagle", "uri": "file:///heads/e"}, "routing": {"byPromptType": {"code": "ngram",
                                                                                         "chat": "none"}}},
    {"draft": {"method": "draft-model", "uri": "/models/small"}, "routing": {"default": "draft-model"},
     "canary": {"weight": 5, "overrides": {"speculation": {"kInitial": 6, "kMax": 6}, "dtype": "float32"}}},
    {"draft": {"method": "none"}, "routing": {"byPromptType": {"code": "ngram"}}},
    {"engine": {"name": "vllm", "vllm": {"image": "vllm/vllm-openai@sha256:" + "0" * 64, "eagleMethod": "eagle3",
                                         "args": ["--max-model-len", "8192", "--model-impl", "vllm", "-tp", "2"],
                                         "pools": {"none": {"replicas": 1}}, "shmSize": "8Gi"}}},
])
def test_a_spec_vllm_can_serve_passes_schema_cel_and_operator(over):
    """Valid: the CRD admits it and the operator finds nothing wrong in it (the engine is served:
    vllm_api.SERVED_ENGINES), so it renders the fleet's pools."""
    doc = _vllm(over)
    validate_openapi(doc)
    assert cel_failures(doc) == []
    assert specs.problems(doc["spec"]) == []
    assert vllm_api.VLLM in vllm_api.SERVED_ENGINES


def test_an_engine_the_operator_does_not_serve_is_unsupported_naming_the_engine(monkeypatch):
    """The gate that holds an engine the CRD names before the fleet serves it (none today): Ready
    False, reason Unsupported, on spec.engine.name."""
    doc = _vllm({})
    monkeypatch.setattr(vllm_api, "SERVED_ENGINES", (vllm_api.SPECFLEET,))
    (problem,) = specs.problems(doc["spec"])
    assert (problem.field, problem.reason) == ("spec.engine.name", specs.UNSUPPORTED)
    assert problem.message == "engine 'vllm' is not served yet; served: specfleet"


def test_a_remote_target_is_left_to_the_operators_unsupported_as_for_the_workers():
    doc = _vllm({"model": {"name": "m", "uri": "hf://org/m"}})
    assert cel_failures(doc) == []
    assert {p.reason for p in specs.problems(doc["spec"])} == {specs.UNSUPPORTED}


def test_the_engine_enums_and_defaults_are_specfleet_apis():
    engine = specs.spec_schema()["properties"]["engine"]
    assert tuple(engine["properties"]["name"]["enum"]) == vllm_api.ENGINES
    assert engine["properties"]["name"]["default"] == vllm_api.SPECFLEET and engine["default"] == {}
    conf = engine["properties"]["vllm"]["properties"]
    assert tuple(conf["eagleMethod"]["enum"]) == vllm_api.EAGLE_METHODS
    assert conf["eagleMethod"]["default"] == vllm_api.EAGLE_METHODS[0]
    assert conf["shmSize"]["default"] == vllm_api.SHM_SIZE
    lookup = conf["ngram"]["properties"]
    assert (lookup["promptLookupMin"]["default"], lookup["promptLookupMax"]["default"]) == (
        vllm_api.PROMPT_LOOKUP_MIN, vllm_api.PROMPT_LOOKUP_MAX)
    (rule,) = conf["args"]["items"]["x-kubernetes-validations"]
    assert rule == {"rule": f"!self.matches('{vllm_api.OWNED_ARG}')", "message": vllm_api.ARGS}
    assert f"m in [{', '.join(repr(m) for m in enums.METHODS)}]" in str(engine["properties"]["vllm"])
    for image in (vllm_api.GPU_IMAGE, vllm_api.CPU_IMAGE):  # the description names the pins
        assert image in conf["image"]["description"]


#: Each field of a vLLM spec: the value vLLM serves first, then others drawn when the field is one of
#: the (at most two) a case changes: some vLLM cannot serve, some it can.
VLLM_FIELDS = {
    "k": [("fixed", 4, 4), ("adaptive", 4, 4), ("fixed", 2, 4), ("fixed", 0, 0), ("entropy", 1, 6), ("fixed", 6, 6)],
    "branching": [None, 1, 2], "guard": [False, True], "tuning": [False, True], "corpus": [0, 512],
    "quantization": ["none", "int8"], "scaling": [False, True], "image": [False, True],
    "method": ["ngram", *enums.METHODS], "uri": [None, "/d", "d", "/d.gguf", "file:///d", "hf://o/d"],
    "model": ["/m", "m", "file:///m", "gguf:///m.gguf", "m.gguf", "hf://o/m"], "source": [False, True],
    "routes": [(), ("ngram",), ("none", "eagle"), ("medusa",), ("draft-model", "ngram")],
    # (a canary method that needs weights and has none is the operator's alone to refuse, engine or not)
    "canary": [None, {}, {"kPolicy": "adaptive"}, {"kMax": 6}, {"kMax": 6, "kInitial": 6}, {"method": "none"},
               {"method": "eagle", "uri": "/c"}, {"uri": "c"}, {"image": True}, {"tree": True}, {"kPolicy": "fixed"}],
    "args": [(), ("--seed", "1"), ("--model", "x"), ("--served_model_name=x",), ("-q", "fp8"), ("--dtype=float16",),
             ("--speculative-config.method", "ngram"), ("-tp", "2", "--max-model-len", "4096")],
}
vllm_strategy = st.sets(st.sampled_from(sorted(VLLM_FIELDS)), max_size=2).flatmap(lambda changed: st.fixed_dictionaries(
    {f: st.sampled_from(v) if f in changed else st.just(v[0]) for f, v in VLLM_FIELDS.items()}))


@settings(max_examples=300, deadline=None)
@given(vllm_strategy)
def test_operator_checks_agree_with_cel_on_what_vllm_can_serve(drawn):
    policy, k_init, k_max = drawn["k"]
    model = drawn["model"]
    if drawn["source"] and model in ("/m", "file:///m"):  # under the mount (outside it is the operator's to refuse)
        model = model.replace("/m", "/var/cache/specfleet/m")
    s = {"engine": {"name": "vllm", "vllm": {"args": list(drawn["args"])}},
         "model": {"name": "m", "uri": model, **({"source": {"pvc": {"claimName": "w"}}} if drawn["source"] else {})},
         "draft": {"method": drawn["method"], "ngram": {"corpusTokens": drawn["corpus"]}},
         "speculation": {"kPolicy": policy, "kMin": 0, "kInitial": k_init, "kMax": k_max,
                         **({"tree": {"branching": drawn["branching"]}} if drawn["branching"] else {}),
                         **({"latencyGuard": {"maxSlowdownPercent": 2}} if drawn["guard"] else {}),
                         "kTuning": {"enabled": drawn["tuning"]}},
         "quantization": drawn["quantization"],
         "routing": {"byPromptType": dict(zip(("code", "chat"), drawn["routes"]))},
         **({"scaling": {"maxReplicas": 2}} if drawn["scaling"] else {"replicas": 1}),
         **({"template": {"image": "w:1"}} if drawn["image"] else {})}
    if drawn["uri"]:
        s["draft"]["uri"] = drawn["uri"]
    if drawn["canary"] is not None:
        c, over = drawn["canary"], {}
        if {"kPolicy", "kMax", "kInitial", "tree"} & set(c):
            over["speculation"] = {**{k: c[k] for k in ("kPolicy", "kMax", "kInitial") if k in c},
                                   **({"tree": {"depth": 0}} if c.get("tree") else {})}
        if {"method", "uri"} & set(c):
            over["draft"] = {k: c[k] for k in ("method", "uri") if k in c}
        if c.get("image"):
            over["image"] = "w:2"
        s["canary"] = {"weight": 5, "overrides": over}
    doc = defaulted({**GOOD, "spec": s})
    validate_openapi(doc)
    failures, problems = cel_failures(doc), specs.problems(doc["spec"])
    event("accepted" if not failures else "refused")  # `pytest --hypothesis-show-statistics` shows both occur
    # hf:// and s3:// URIs pass CEL: the operator alone holds them at Unsupported, as for the workers
    assert (failures == []) == ([p for p in problems if p.reason != specs.UNSUPPORTED] == []), (failures, problems)
    ours = {getattr(vllm_api, n) for n in ("K_POLICY", "K_STATIC", "TREE", "LATENCY_GUARD", "K_TUNING", "NGRAM",
                                            "QUANTIZATION", "SCALING", "IMAGE", "ROUTES", "GGUF", "MODEL_PATH",
                                            "DRAFT_URI", "ARGS")}
    assert set(failures) & ours == {p.message for p in problems} & ours, (failures, problems)
