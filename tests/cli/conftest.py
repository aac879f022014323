"""An emulated cluster for the commands that talk to the API server (specfleet_operator.testing)."""
from __future__ import annotations

import kmock
import pytest

from specfleet_operator.testing import Cluster, declare_resources, write_kubeconfig


@pytest.fixture()
async def cluster():
    async with Cluster() as handler, kmock.Server(handler):
        declare_resources(handler)
        yield handler


@pytest.fixture()
def kubeconfig(cluster, tmp_path):
    """A kubeconfig for the emulator, its context's namespace `default`."""
    path = tmp_path / "kubeconfig"
    write_kubeconfig(path, cluster.endpoint)
    return path
