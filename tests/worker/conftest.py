"""Fixtures for the worker's tests (helpers live in specfleet_worker.testing)."""
from __future__ import annotations

import pytest
import torch

from specfleet_worker.testing import running_worker

# The tiny model gains nothing from intra-op threads, and on a shared machine their spinning
# costs more than the work: one thread keeps the suite fast and its timing steady.
torch.set_num_threads(1)


@pytest.fixture()
def worker():
    with running_worker() as r:
        yield r

