import pathlib

import pytest
import torch

TESTS = pathlib.Path(__file__).parent

# Folders whose tests run whole fleets (workers, routers, Redis, the loop) and judge what they do
# over time: `./dev test` runs them (and every `slow` test: the real model on two threads) after
# the rest, one at a time, with the machine to themselves (see `run_tests` in ./dev).
ALONE = ("local", "fault")

# Files of costly, independent cases: `./dev test`'s parallel part spreads their tests over its
# workers one by one; every other file's tests stay on one worker (its module fixtures, some of
# them minutes of interpreted Triton, are built once).
SPREAD = ("tests/engine/test_lossless_sampling.py", "tests/engine/test_lossless_greedy.py")


@pytest.hookimpl(tryfirst=True)  # before -m selects by this mark
def pytest_collection_modifyitems(config, items):
    """Marks the tests `./dev test` runs `alone` (above); the rest run in its parallel part."""
    for item in items:
        in_alone_folder = item.path.is_relative_to(TESTS) and item.path.relative_to(TESTS).parts[0] in ALONE
        if in_alone_folder or item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.alone)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, called with -n
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, but the SPREAD files' tests are scheduled one by one."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path in SPREAD else path

    return Scheduling(config, log)


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
