"""Fixtures for the router's tests: real workers (the tiny random model with a character
tokenizer, real gRPC on loopback) and routers in front of them (specfleet_router.testing)."""
from __future__ import annotations

import contextlib

import openai
import pytest
import torch

from specfleet_engine.proposers.ngram import NgramProposer
from specfleet_router.testing import running_router
from specfleet_worker.testing import CharTokenizer, SlowProposer, running_worker, tiny_engine

torch.set_num_threads(1)




def target(w) -> str:
    return f"127.0.0.1:{w.server.grpc_port}"


def text_worker(**kw):
    """A worker that reads and writes text (one character, one token)."""
    proposers = kw.pop("proposers", None)
    engine = tiny_engine(CharTokenizer(), proposers={"ngram": NgramProposer(), **(proposers or {})})
    return running_worker(engine, **kw)


def client(router, **kw) -> openai.OpenAI:
    """The official client, without its own retries (they would hide a 429 or 503)."""
    return openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=30, **kw)


@contextlib.contextmanager
def router_over(stable=(), canary=(), **kw):
    """A router with these workers (or host:port strings) in each arm, waited on until every
    live one is ready."""
    def targets(ws):
        return [w if isinstance(w, str) else target(w) for w in ws]

    with running_router(backends={"stable": targets(stable), "canary": targets(canary)}, **kw) as r:
        if kw.get("health_check", True):
            r.wait_ready(sum(not isinstance(w, str) for w in stable), sum(not isinstance(w, str) for w in canary))
        yield r


# test modules cannot import this conftest (--import-mode=importlib): they get the helpers as fixtures
@pytest.fixture(scope="session")
def h():
    """The helpers: h.text_worker, h.router_over, h.client, h.target, h.SlowProposer."""
    import types

    return types.SimpleNamespace(text_worker=text_worker, router_over=router_over, client=client, target=target,
                                 SlowProposer=SlowProposer)


@pytest.fixture(scope="module")
def worker():
    with text_worker() as w:
        yield w


@pytest.fixture(scope="module")
def router(worker):
    with router_over([worker], model_aliases=["tiny-random"]) as r:
        yield r
