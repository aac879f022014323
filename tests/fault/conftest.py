"""Fixtures for the fault scenarios: in-process tiny workers that read and write text, a router
in front of them (specfleet_router.testing), and `specfleet serve` worker processes to SIGKILL."""
from __future__ import annotations

import contextlib
import json
import types

import pytest
import torch

from specfleet_engine.proposers.ngram import NgramProposer
from specfleet_router.testing import running_router
from specfleet_worker.testing import CharTokenizer, running_worker, tiny_engine

torch.set_num_threads(1)


def target(w) -> str:
    return f"127.0.0.1:{w.server.grpc_port}"


def text_worker(proposer=None, **kw):
    """An in-process worker on the tiny random model (one character, one token)."""
    return running_worker(tiny_engine(CharTokenizer(), proposers={"ngram": proposer or NgramProposer()}), **kw)


@contextlib.contextmanager
def router_over(stable=(), canary=(), **kw):
    """A router over these in-process workers (or host:port strings), once every one is ready."""
    def targets(ws):
        return [w if isinstance(w, str) else target(w) for w in ws]

    with running_router(backends={"stable": targets(stable), "canary": targets(canary)}, **kw) as r:
        r.wait_ready(len(stable), len(canary), timeout_s=30)
        yield r


def worker_config(path, role="stable"):
    """A `specfleet serve` config for the tiny random model (text in, text out)."""
    path.write_text(json.dumps({"model": {"name": "tiny-random", "uri": None}, "draft": {"method": "ngram"},
                                "speculation": {"kMin": 0, "kMax": 8}, "role": role}))
    return path


# test modules cannot import this conftest (--import-mode=importlib): they get the helpers as a fixture
@pytest.fixture(scope="session")
def h():
    return types.SimpleNamespace(text_worker=text_worker, router_over=router_over, target=target,
                                 worker_config=worker_config)


@pytest.fixture(scope="module")
def arms():
    """One in-process worker per arm."""
    with text_worker() as stable, text_worker() as canary:
        yield types.SimpleNamespace(stable=stable, canary=canary)
