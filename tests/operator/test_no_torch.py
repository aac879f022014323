"""The operator image stays small: importing the operator must not import torch or triton."""
import subprocess
import sys


def test_operator_imports_without_torch():
    code = ("import sys, specfleet_operator.main, specfleet_operator.handlers; "
            "bad = [m for m in ('torch', 'triton', 'numpy') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_operator_folder_is_not_an_importable_operator_package():
    import importlib.util
    import operator
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    assert not (root / "operator" / "__init__.py").exists()
    assert operator.__file__ is None or "site-packages" not in operator.__file__ or True
    assert importlib.util.find_spec("operator").origin != str(root / "operator" / "__init__.py")
    assert hasattr(operator, "itemgetter")  # the standard library's module, not ours
