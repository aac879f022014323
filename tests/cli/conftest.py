"""An emulated cluster for the commands that talk to the API server (specfleet_operator.testing)."""
from __future__ import annotations

import kmock
import pytest
import yaml

from specfleet_operator.testing import Cluster, declare_resources


@pytest.fixture()
async def cluster():
    async with Cluster() as handler, kmock.Server(handler):
        declare_resources(handler)
        yield handler


@pytest.fixture()
def kubeconfig(cluster, tmp_path):
    """A kubeconfig for the emulator, its context's namespace `default`."""
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "emu",
        "clusters": [{"name": "emu", "cluster": {"server": cluster.endpoint}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "u", "namespace": "default"}}]}))
    return path
