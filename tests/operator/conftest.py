"""Fixtures: a fresh emulated cluster per test (specfleet_operator.testing) and a client for it."""
from __future__ import annotations

import kmock
import kopf
import pytest

from specfleet_operator.kube import Kube
from specfleet_operator.testing import Cluster, declare_resources


@pytest.fixture()
async def cluster():
    async with Cluster() as handler, kmock.Server(handler):
        declare_resources(handler)
        yield handler


@pytest.fixture()
async def kube(cluster):
    client = Kube(kopf.ConnectionInfo(server=cluster.endpoint))
    yield client
    await client.close()
