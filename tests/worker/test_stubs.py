"""The committed gRPC stubs are what the .proto files generate today."""
from __future__ import annotations

import re

from specfleet_proto import codegen

# what names the generator's version, not the API: a newer grpcio-tools alone is no staleness
VERSIONS = [re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M), re.compile(r"^# Protobuf Python Version: .*$", re.M),
            re.compile(r"ValidateProtobufRuntimeVersion\(.*?\)", re.S)]


def normalise(text: str) -> str:
    for pattern in VERSIONS:
        text = pattern.sub("<version>", text)
    return text


def test_normalising_hides_versions_only():
    a = "GRPC_GENERATED_VERSION = '1.85.1'\nx = ValidateProtobufRuntimeVersion(\n    7,\n    35,\n)\nrpc Foo"
    b = "GRPC_GENERATED_VERSION = '1.90.0'\nx = ValidateProtobufRuntimeVersion(\n    7,\n    40,\n)\nrpc Foo"
    assert normalise(a) == normalise(b) != normalise(b.replace("Foo", "Bar"))


def test_committed_stubs_are_current():
    fresh = codegen.generate()
    assert sorted(fresh) == sorted(p.name for p in codegen.OUT.glob("worker_pb2*"))
    for name, text in fresh.items():
        committed = (codegen.OUT / name).read_text()
        assert normalise(committed) == normalise(text), (
            f"{name} is stale: run `python -m specfleet_proto.codegen` and commit the result")
