import pathlib

import pytest
import torch

TESTS = pathlib.Path(__file__).parent

# Folders whose tests run whole fleets (workers, routers, Redis, the loop) and judge what they do
# over time: `./dev test` runs them (and every `slow` test: the real model on two threads) after
# the rest, one at a time, with the machine to themselves (see `run_tests` in ./dev).
ALONE = ("local", "fault")


@pytest.hookimpl(tryfirst=True)  # before -m selects by these marks
def pytest_collection_modifyitems(config, items):
    """Marks each test for ./dev test's two parts: `alone` (above), or the parallel part, where a
    test file's tests share one xdist worker (its module fixtures are built once) unless the file
    is marked `spread` (costly, independent cases: any worker may take any one)."""
    for item in items:
        folder = pathlib.Path(item.path).relative_to(TESTS).parts[0]
        if folder in ALONE or item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.alone)
        elif item.get_closest_marker("spread") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.name))


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
