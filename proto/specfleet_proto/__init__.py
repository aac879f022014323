"""Generated protobuf and gRPC stubs (see codegen.py)."""
