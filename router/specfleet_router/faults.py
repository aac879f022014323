"""The fault harness: a load of requests from many client threads through the router's OpenAI API
(the official `openai` client, streaming and unary mixed), a fault injected mid-load, and one
record per request of what its client saw (ok, error code, whether a token had streamed before it
failed, latency). Used by tests/fault and by the control loop's chaos tests.

    report = run_load(router.base_url, model="chat", fault=lambda: redis.kill())
    assert not report.lost(), report.summary()
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import openai


@dataclass
class Outcome:
    """What one request's client saw."""

    index: int
    stream: bool
    started: float  # time.monotonic() when it was sent
    latency_s: float = 0.0
    ok: bool = False
    error: str | None = None  # the HTTP status ("503"), "connection", "timeout" or the exception's class
    message: str = ""  # the error's message as the client got it
    streamed: bool = False  # a token arrived before it ended (ok or not)
    arm: str | None = None  # x-specfleet-arm, when the response had headers

    @property
    def ended(self) -> float:
        return self.started + self.latency_s


@dataclass
class LoadReport:
    outcomes: list[Outcome]
    fault_at: float | None = None  # time.monotonic() when the fault was injected
    wall_s: float = 0.0
    timeout_s: float = 0.0
    notes: dict = field(default_factory=dict)

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def lost(self) -> list[Outcome]:
        """Failures of requests that had streamed nothing: the router could have retried them."""
        return [o for o in self.failed() if not o.streamed]

    def hung(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error == "timeout" or o.latency_s >= self.timeout_s]

    def in_flight_at_fault(self) -> list[Outcome]:
        return [o for o in self.outcomes if self.fault_at is not None and o.started < self.fault_at < o.ended]

    def summary(self) -> str:
        errors: dict[str, int] = {}
        for o in self.failed():
            key = f"{o.error}{' after a token' if o.streamed else ''}"
            errors[key] = errors.get(key, 0) + 1
        lat = sorted(o.latency_s for o in self.outcomes) or [0.0]
        return (f"{len(self.outcomes)} requests in {self.wall_s:.1f} s: {sum(o.ok for o in self.outcomes)} ok, "
                f"errors {errors or 'none'}, {len(self.in_flight_at_fault())} in flight at the fault, "
                f"latency p50 {lat[len(lat) // 2]:.3f} s max {lat[-1]:.3f} s")


def one_request(c: openai.OpenAI, model: str, i: int, *, stream: bool, max_tokens: int, prompt: str,
                headers: dict[str, str]) -> Outcome:
    """Request `i` (chat, streaming or not) and what its client saw; never raises for an API error."""
    out = Outcome(i, stream, time.monotonic())
    messages = [{"role": "user", "content": f"{prompt} {i}"}]
    try:
        if stream:
            raw = c.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=max_tokens,
                                                              temperature=0, stream=True, extra_headers=headers)
            out.arm = raw.headers.get("x-specfleet-arm")
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    out.streamed = True
        else:
            raw = c.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=max_tokens,
                                                              temperature=0, extra_headers=headers)
            out.arm = raw.headers.get("x-specfleet-arm")
            if raw.parse().usage.completion_tokens < 1:
                raise ValueError("no completion tokens in a successful response")
        out.ok = True
    except openai.APITimeoutError as e:
        out.error, out.message = "timeout", str(e)
    except openai.APIConnectionError as e:
        out.error, out.message = "connection", str(e)
    except openai.APIStatusError as e:
        out.error, out.message = str(e.status_code), e.message
    except openai.APIError as e:  # an SSE error event in the middle of a stream
        out.error, out.message = "stream-error", e.message
    except Exception as e:  # anything else is a finding too: record it, never lose the request
        out.error, out.message = type(e).__name__, str(e)
    out.latency_s = time.monotonic() - out.started
    return out


def run_load(base_url: str, *, model: str, requests: int = 200, clients: int = 16, max_tokens: int = 16,
             fault: Callable[[], None] | None = None, fault_after: int | None = None,
             stream_every: int = 2, timeout_s: float = 20.0, prompt: str = "Tell me about the sea",
             headers: dict[str, str] | None = None) -> LoadReport:
    """`requests` chat requests from `clients` threads (every `stream_every`-th one streaming), with
    `fault()` called on a thread of its own once `fault_after` requests (default a quarter) have
    finished, so that the rest of the load runs through it. Each client times out after
    `timeout_s`; the whole load must end within its own bound too, or TimeoutError."""
    fault_after = requests // 4 if fault_after is None else fault_after
    done = threading.Semaphore(0)
    report = LoadReport([], timeout_s=timeout_s)

    def inject():
        for _ in range(fault_after):
            if not done.acquire(timeout=timeout_s):
                return
        report.fault_at = time.monotonic()
        try:
            fault()
        except BaseException as e:  # raised on the test's thread once the load is over
            report.notes["fault_error"] = e

    c = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s)

    def work(i):
        try:
            return one_request(c, model, i, stream=i % stream_every == 0, max_tokens=max_tokens, prompt=prompt,
                               headers=headers or {})
        finally:
            done.release()

    start = time.monotonic()
    injector = threading.Thread(target=inject, name="fault", daemon=True) if fault else None
    if injector:
        injector.start()
    with ThreadPoolExecutor(clients, thread_name_prefix="client") as pool:
        futures = [pool.submit(work, i) for i in range(requests)]
        bound = timeout_s * (requests / clients + 2)
        report.outcomes = [f.result(timeout=max(1.0, bound - (time.monotonic() - start))) for f in futures]
    if injector:
        injector.join(timeout_s)
        if injector.is_alive():
            raise TimeoutError(f"the fault did not finish within {timeout_s} s")
        if "fault_error" in report.notes:
            raise RuntimeError("the fault itself failed") from report.notes["fault_error"]
    report.wall_s = time.monotonic() - start
    c.close()
    return report
