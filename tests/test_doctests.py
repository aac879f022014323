"""The doctests of every module of every package the distribution ships (pyproject.toml's package
folders), one test per module that has any: a new module's examples run without anyone listing
it. Modules are found on disk and each is imported by its own test only, so collecting stays cheap
(no torch at collection)."""
import doctest
import importlib
import pathlib
import tomllib

import pytest

ROOT = pathlib.Path(__file__).parent.parent


def modules_with_examples() -> list[str]:
    """The dotted names of the shipped modules (in a package, every folder down to them holding an
    __init__.py, as setuptools finds them) whose source holds a `>>>` example."""
    where = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["where"]
    names = []
    for folder in (ROOT / f for f in where):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            in_packages = all((folder.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts)))
            if len(parts) > 1 and in_packages and ">>>" in path.read_text(encoding="utf-8"):
                names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)  # the same order in every process (pytest-xdist's workers compare)


MODULES = modules_with_examples()


def test_the_packages_are_found():
    """The walk above sees the packages (a moved folder would silently run nothing)."""
    packages = {name.split(".")[0] for name in MODULES}
    assert {"specfleet_api", "specfleet_operator", "specfleet_router", "specfleet_control", "specfleet_local",
            "specfleet_bench", "specfleet_engine", "specfleet_worker"} <= packages, packages
    assert {"specfleet_api.redis_auth", "specfleet_operator.leader", "specfleet_router.k8s_discovery",
            "specfleet_engine.proposers.ngram"} <= set(MODULES)  # a subpackage's too


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_in_the_docstrings_hold(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, report=True)  # a failure's example and output go to the captured stdout
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (stdout)"
