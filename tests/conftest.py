import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny models run fastest on one thread; tests of the real model ask for more."""
    if request.node.get_closest_marker("slow") is None:
        torch.set_num_threads(1)
    else:
        torch.set_num_threads(2)
    yield


@pytest.fixture
def redis_server():
    """A redis-server of its own on a free loopback port, stopped after the test."""
    from specfleet_local.redis_server import RedisServer

    with RedisServer() as server:
        yield server
