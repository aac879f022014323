"""specfleet_api is the one home of what a deployment may ask for: its docstrings hold, and no
other Python file spells out its own list of methods, precisions, devices or K policies."""
import ast
import doctest
import pathlib

from specfleet_api import engine_config, enums, tree_shape

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ["api", "cli", "operator", "proto", "worker", "bench"]
GENERIC = {"none", "auto"}  # words that are not a list of ours on their own
NAMES = (set(enums.METHODS) | set(enums.QUANTIZATIONS) | set(enums.DTYPES) | set(enums.K_POLICIES)
         | set(enums.DTYPE_ALIASES) | set(enums.DEVICES)) - GENERIC
#: Files that still hold such a list, each with its owner's reason; shrink it, never grow it.
KNOWN: set[str] = set()


def test_the_docstrings_hold():
    for module in (enums, engine_config, tree_shape):
        assert doctest.testmod(module).failed == 0


def literal_lists(path: pathlib.Path) -> list[tuple[int, list[str]]]:
    """(line, values) of every tuple, list or set literal holding two or more of NAMES."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            values = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(set(values) & (NAMES | GENERIC)) >= 2 and set(values) & NAMES:
                out.append((node.lineno, values))
    return out


def test_one_list_of_methods_and_precisions_in_the_python_code():
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("api/specfleet_api/") or "_pb2" in rel:
                continue
            lists = literal_lists(path)
            if lists:
                found[rel] = lists
    assert set(found) <= KNOWN, {k: v for k, v in found.items() if k not in KNOWN}


def test_the_check_finds_a_list_where_there_is_one(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('METHODS = ("ngram", "draft-model", "none")\nDT = ["fp32", "bf16"]\nOK = ("a", "none")\n'
                   'DEV = {"cpu", "cuda"}\n')
    assert [line for line, _ in literal_lists(bad)] == [1, 2, 4]
