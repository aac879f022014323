"""The committed gRPC stubs are what the .proto files generate today."""
from __future__ import annotations

import re

from specfleet_worker.server import codegen

# lines that name the generator's version, not the API
VERSION_LINE = re.compile(r"^(GRPC_GENERATED_VERSION = .*|# Protobuf Python Version: .*|\s*\d+,\s*\d+,\s*\d+,\s*'.*',)$", re.M)


def normalise(text: str) -> str:
    return VERSION_LINE.sub("<version>", text)


def test_committed_stubs_are_current():
    fresh = codegen.generate()
    assert sorted(fresh) == sorted(p.name for p in codegen.OUT.glob("worker_pb2*"))
    for name, text in fresh.items():
        committed = (codegen.OUT / name).read_text()
        assert normalise(committed) == normalise(text), (
            f"{name} is stale: run `python -m specfleet_worker.server.codegen` and commit the result")
