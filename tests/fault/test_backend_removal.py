"""A backend that discovery removes (its pod is going away) finishes the requests in flight on it:
its channel closes with a grace, not at once."""
from __future__ import annotations

import asyncio
import time

import openai

from specfleet_engine.proposers.ngram import NgramProposer


class SlowProposer(NgramProposer):
    """Keeps a request running while the test removes its backend."""

    def propose(self, seqs, ks):
        time.sleep(0.03)
        return super().propose(seqs, ks)


class Changing:
    """A Discovery whose picture the test publishes."""

    def __init__(self):
        self.updates = None  # made on the router's loop

    async def watch(self):
        self.updates = asyncio.Queue()
        while True:
            yield await self.updates.get()


def test_a_request_in_flight_on_a_removed_backend_completes(h):
    discovery = Changing()
    with h.text_worker(SlowProposer()) as w, h.router_over(discovery=discovery) as r:
        def publish(targets):
            r.loop.call_soon_threadsafe(discovery.updates.put_nowait, targets)

        end = time.monotonic() + 5
        while discovery.updates is None:
            assert time.monotonic() < end
            time.sleep(0.01)
        publish({"stable": [h.target(w)]})
        r.wait_ready(1)
        c = openai.OpenAI(base_url=r.base_url, api_key="unused", max_retries=0, timeout=20)
        stream = c.chat.completions.create(model="specfleet", messages=[{"role": "user", "content": "Hello"}],
                                           max_tokens=48, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = iter(stream)
        text = ""
        while not text:
            text += next(chunks).choices[0].delta.content or ""
        publish({"stable": []})
        end = time.monotonic() + 5
        while r.server.backends.pools["stable"].backends:
            assert time.monotonic() < end, "discovery's removal was not applied"
            time.sleep(0.01)
        finish = usage = None
        for chunk in chunks:  # an error event would raise openai.APIError here
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        assert finish == "length" and usage.completion_tokens == 48, (finish, usage)
