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
