"""The torch-free rule: the operator, the router, the gRPC stubs, specfleet_api and the CLI's dispatcher import
(and `specfleet --help` runs) in a process where torch and triton cannot be imported at all."""
import importlib.util
import operator
import os
import pathlib
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK = ("import sys\n"
         "class Block:\n"
         "    def find_spec(self, name, *_):\n"
         "        if name.split('.')[0] in ('torch', 'triton'):\n"
         "            raise ImportError(f'{name} is blocked: this import path must stay torch-free')\n"
         "sys.meta_path.insert(0, Block())\n")


def run_blocked(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=120, env=env)


def test_the_block_works():
    """Without this the other tests here could pass for the wrong reason."""
    result = run_blocked("import torch")
    assert result.returncode != 0 and "is blocked" in result.stderr


@pytest.mark.parametrize("modules, also_absent", [
    (["specfleet_operator.main", "specfleet_operator.handlers"], ["numpy"]),  # the operator image
    (["specfleet_proto.worker_pb2", "specfleet_proto.worker_pb2_grpc"], ["numpy"]),  # a router's stubs
    (["specfleet_api", "specfleet_api.enums", "specfleet_api.engine_config", "specfleet_api.windows",
      "specfleet_api.vllm"],
     ["numpy", "kopf", "grpc"]),
    (["specfleet_control.loop", "specfleet_control.slo", "specfleet_control.canary", "specfleet_control.observe"],
     ["numpy", "kopf", "grpc", "prometheus_client"]),  # the loop: pure
    (["specfleet_cli.main", "specfleet_worker.main", "specfleet_worker.config"], ["numpy"]),
    (["specfleet_router.main", "specfleet_router.server", "specfleet_router.testing",
      "specfleet_router.vllm_evidence"], ["numpy"]),  # the router
], ids=["operator", "stubs", "api", "control", "cli", "router"])
def test_imports_without_torch(modules, also_absent):
    code = ("import importlib\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            f"bad = [m for m in {['torch', 'triton', *also_absent]!r} if m in sys.modules]\n"
            "assert not bad, bad\n")
    result = run_blocked(code)
    assert result.returncode == 0, result.stderr


def test_specfleet_help_runs_without_torch():
    code = ("from specfleet_cli.main import main\n"
            "try:\n"
            "    main(['--help'])\n"
            "except SystemExit as e:\n"
            "    assert e.code in (0, None), e.code\n"
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules\n")
    result = run_blocked(code)
    assert result.returncode == 0, result.stderr
    for command in ("demo", "generate", "bench", "serve", "operator", "router"):
        assert command in result.stdout


def test_operator_folder_is_not_an_importable_operator_package():
    assert not (ROOT / "operator" / "__init__.py").exists()
    # the standard library's module, not ours, whatever the import path holds
    stdlib = pathlib.Path(sysconfig.get_path("stdlib")).resolve()
    assert pathlib.Path(operator.__file__).resolve().parent == stdlib
    assert importlib.util.find_spec("operator").origin == operator.__file__
    assert hasattr(operator, "itemgetter")
