"""The scheduler thread: the only code that touches the engine.

gRPC handlers `submit` a `Request` and read its `events` queue; the thread admits queued requests
into the running batch at step boundaries (bounded by batch size and by KV blocks reserved for
each request's worst case, so a step never runs out of blocks), applies cancellations and
deadlines (the sequence's KV blocks are freed before the next step), sets each request's K from
the controller and the live settings, runs `engine.step()`, and routes the new tokens back.
Admission is decided in `submit`, under the lock: beyond `max_batch_size + max_queue` requests
in the worker, RESOURCE_EXHAUSTED at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import grpc

from specfleet_engine.engine import NO_SPECULATION, Engine, Sequence
from specfleet_engine.sampling import SamplingParams
from .config import LiveConfig
from .kcontrol import KController, KState, StepCostModel, geometric_alpha
from .metrics import Metrics
from .tracing import result_attributes

log = logging.getLogger("specfleet.worker")

MAX_K = 32  # the most K the live settings accept: KV reservations leave room for it


class Rejected(Exception):
    """A request refused before or while running; `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Event:
    kind: str  # "tokens" | "done" | "error"
    tokens: list[int] | None = None
    logprobs: list[float] | None = None
    error: Rejected | None = None


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, method: str,
                 prompt_type: str, k_initial: int, deadline: float | None = None, span=None):
        self.request_id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.method, self.prompt_type, self.deadline, self.span = method, prompt_type, deadline, span
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.kstate = KState(k_initial)
        self.k_sum = self.k_steps = 0
        self.seq: Sequence | None = None
        self.cancelled = False
        self.done = False
        self.reserved_blocks = 0
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._sent_logprobs = 0
        self._draft_errors = 0


class Scheduler:
    def __init__(self, engine: Engine, live: LiveConfig, metrics: Metrics, *, max_batch_size: int = 16,
                 max_queue: int = 64, idle_wait_s: float = 0.5):
        self.engine, self.live, self.metrics = engine, live, metrics
        self.max_batch_size, self.max_queue, self.idle_wait_s = max_batch_size, max_queue, idle_wait_s
        self.cost = StepCostModel()
        self.controller = KController(self.cost)
        self._cond = threading.Condition()
        self._pending: deque[Request] = deque()
        self._active: list[Request] = []  # the running batch; only the scheduler thread touches it
        self._count = 0  # pending + running, under the lock: what admission counts
        self._reserved = 0  # KV blocks reserved by the running batch
        self._by_type: dict[str, deque] = {}  # prompt type -> its last verify steps (accepted, drafted)
        self._speedup_window: deque[tuple[float, float]] = deque(maxlen=256)  # (plain-equivalent s, actual s)
        self._speedup_sums = (0.0, 0.0)  # the window's sums, one tuple so other threads read it whole
        self.draining = False
        self._stopped = False
        self.fatal: BaseException | None = None
        self.requests_total = self.rejected_total = self.failed_total = 0
        self.thread = threading.Thread(target=self._run, name="specfleet-scheduler", daemon=True)
        metrics.kv_blocks_total.labels(metrics.model).set(engine.cache.allocator.num_blocks)

    # -- what handlers call (any thread) ------------------------------------------------------

    def start(self) -> Scheduler:
        self.thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.fatal is None

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        """KV blocks a request may hold at worst: its whole context plus a full draft."""
        tokens = min(prompt_len + max_tokens, self.engine.max_len) + MAX_K + 1
        return -(-tokens // self.engine.cache.block_size)

    def submit(self, req: Request) -> None:
        """Queues the request, or raises Rejected (UNAVAILABLE while draining, RESOURCE_EXHAUSTED when full)."""
        req.reserved_blocks = self.blocks_needed(len(req.prompt_ids), req.params.max_tokens)
        with self._cond:
            if self.draining or self._stopped or not self.alive:
                self.count_rejection("draining")
                raise Rejected(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down; send the request elsewhere")
            limit = self.max_batch_size + self.max_queue
            if self._count >= limit:
                self.count_rejection("overload")
                raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the worker is full: {self._count} requests running or queued, the limit is {limit}")
            self._count += 1
            self._pending.append(req)
            self.metrics.queue_depth.labels(self.metrics.model).set(len(self._pending))
            self._cond.notify()

    def cancel(self, req: Request) -> None:
        """The caller went away (cancelled, disconnected, past its deadline): stop at the next step."""
        with self._cond:
            if not req.done:
                req.cancelled = True
                self._cond.notify()

    def in_flight(self) -> int:
        with self._cond:
            return self._count

    def queue_depth(self) -> int:
        with self._cond:
            return len(self._pending)

    def running(self) -> int:
        return len(self._active)

    def drain(self, timeout_s: float) -> bool:
        """Refuses new requests and waits for those in flight; True when all finished in time."""
        end = time.monotonic() + timeout_s
        with self._cond:
            self.draining = True
            while self._count and time.monotonic() < end:
                self._cond.wait(timeout=min(0.05, max(end - time.monotonic(), 0.001)))
            return self._count == 0

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ends the thread; requests still in flight end with UNAVAILABLE."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout_s)

    def speedup_ratio(self) -> float:
        plain, actual = self._speedup_sums
        return plain / actual if actual > 0 else 1.0

    def count_rejection(self, reason: str) -> None:
        self.rejected_total += 1
        self.metrics.rejected.labels(self.metrics.model, reason).inc()

    # -- the scheduler thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as e:  # noqa: BLE001 - recorded for /healthz, then every request is told
            self.fatal = e
            log.exception("scheduler thread died")
        finally:
            self._fail_all(Rejected(grpc.StatusCode.UNAVAILABLE, "the worker stopped before the request finished"))

    def _iterate(self) -> bool:
        admit: list[Request] = []
        with self._cond:
            while not self._pending and not self._active and not self._stopped:
                self._cond.wait(self.idle_wait_s)
            if self._stopped:
                return False
            now = time.monotonic()
            for req in [r for r in self._pending if r.cancelled or (r.deadline is not None and now > r.deadline)]:
                self._pending.remove(req)
                self._finish_unstarted(req)
            capacity = self.engine.cache.allocator.num_blocks
            while (self._pending and len(self._active) + len(admit) < self.max_batch_size
                   and self._reserved + self._pending[0].reserved_blocks <= capacity):
                req = self._pending.popleft()
                self._reserved += req.reserved_blocks
                admit.append(req)
            if self._pending and not self._active and not admit:  # could never fit (the service checks first)
                req = self._pending.popleft()
                self._finish_unstarted(req, Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                                                     f"max_tokens: the request needs {req.reserved_blocks} KV blocks, "
                                                     f"the cache holds {capacity}"))
            self.metrics.queue_depth.labels(self.metrics.model).set(len(self._pending))
        now = time.monotonic()
        for req in [r for r in self._active if r.cancelled or (r.deadline is not None and now > r.deadline)]:
            self.engine.abort(req.seq)  # frees its KV blocks now
            self._finish(req)
        for req in admit:
            self._start(req)
        if not self._active:
            self._publish_gauges()
            return True
        self._set_ks()
        prefill = bool(self.engine.waiting)
        batch = sum(1 for r in self._active if r.seq.prefilled)
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the batch, keep the worker serving
            log.exception("engine step failed; failing the running batch")
            for req in list(self._active):
                try:
                    self.engine.abort(req.seq)
                except Exception:  # noqa: BLE001 - the engine is what broke; the request is told anyway
                    log.exception("abort after a failed step failed", extra={"request_id": req.request_id})
                self.failed_total += 1
                self.metrics.failed.labels(self.metrics.model).inc()
                self._finish(req, Rejected(grpc.StatusCode.INTERNAL, f"the engine failed: {type(e).__name__}: {e}"))
            return True
        elapsed = time.perf_counter() - t0
        self._route(outputs, elapsed, measure=not prefill and batch > 0)
        self._publish_gauges()
        return True

    def _start(self, req: Request) -> None:
        s = self.live.settings
        history = self._by_type.get(req.prompt_type)
        if req.method != NO_SPECULATION and s.k_policy == "adaptive" and history and len(history) >= 16:
            batch = len(self._active) + 1
            req.kstate = self.controller.start(s.k_initial, geometric_alpha(history, self.controller.prior),
                                               batch, s.k_min, s.k_max)
        try:
            req.seq = self.engine.add(req.prompt_ids, req.params, req.method, req.kstate.k, req.request_id)
        except ValueError as e:  # the service validates first; this is the engine's last word
            with self._cond:
                self._reserved -= req.reserved_blocks
            self._finish_unstarted(req, Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
            return
        self._active.append(req)
        self.metrics.prompt_tokens.labels(self.metrics.model).inc(len(req.prompt_ids))

    def _set_ks(self) -> None:
        s = self.live.settings
        decoding = [r for r in self._active if r.seq.prefilled]
        for req in decoding:
            if req.method == NO_SPECULATION or not s.speculation_enabled:
                req.seq.k = req.seq.k_floor = 0
            else:
                req.seq.k = self.controller.choose(req.kstate, len(decoding), s.k_min, s.k_max,
                                                   adaptive=s.k_policy == "adaptive")
                # an adaptive engine verifies, of each draft, the prefix that pays; never under K_min
                req.seq.k_floor = s.k_min if s.k_policy == "adaptive" else req.seq.k

    def _route(self, outputs, elapsed: float, measure: bool) -> None:
        by_id = {r.seq.seq_id: r for r in self._active}
        tokens_in_forward = emitted = decoded = 0
        now = time.perf_counter()
        for out in outputs:
            req = by_id.get(out.seq.seq_id)
            if req is None:
                continue
            seq = out.seq
            if out.stats is None:  # the prefill's first token
                req.first_token_at = now
            else:
                st = out.stats
                req.k_sum += seq.k
                req.k_steps += 1
                tokens_in_forward += 1 + st.num_draft_tokens
                emitted += st.num_emitted
                decoded += 1
                self.controller.observe(req.kstate, st.num_draft_tokens, st.num_accepted)
                if st.num_draft_tokens:
                    self._by_type.setdefault(req.prompt_type, deque(maxlen=256)).append(
                        (st.num_accepted, st.num_draft_tokens))
                self.metrics.step(req.prompt_type, seq.k, st.num_draft_tokens, st.num_accepted, st.num_emitted)
            errors = seq.stats.draft_errors - req._draft_errors
            if errors:
                req._draft_errors = seq.stats.draft_errors
                self.metrics.draft_error(errors)
            lps = seq.logprobs[req._sent_logprobs:] if req.params.logprobs else None
            req._sent_logprobs = len(seq.logprobs)
            if seq.finished:  # the last tokens travel with "done", so a stream never outruns a stop string
                self._finish(req, tokens=list(out.new_tokens), logprobs=lps)
            elif out.new_tokens:
                req.events.put(Event("tokens", list(out.new_tokens), lps))
        if measure and decoded:
            self.cost.observe(tokens_in_forward, elapsed)
            # what plain decoding would have taken for these tokens, at the fitted cost of a B-token step
            sample = (emitted * self.cost.cost(decoded) / decoded, elapsed)
            plain, actual = self._speedup_sums
            if len(self._speedup_window) == self._speedup_window.maxlen:
                old_plain, old_actual = self._speedup_window[0]
                plain, actual = plain - old_plain, actual - old_actual
            self._speedup_window.append(sample)
            self._speedup_sums = (plain + sample[0], actual + sample[1])

    def _finish(self, req: Request, error: Rejected | None = None, tokens: list[int] | None = None,
                logprobs: list[float] | None = None) -> None:
        if req in self._active:
            self._active.remove(req)
        seq = req.seq
        if req.cancelled and seq.finish_reason != "abort":
            seq.finish_reason = "abort"
        req.finished_at = time.perf_counter()
        m, model = self.metrics, self.metrics.model
        if error is None:
            self.requests_total += 1
            m.requests.labels(model, seq.finish_reason).inc()
            m.e2e.labels(model).observe(req.finished_at - req.arrival)
            if req.first_token_at is not None:
                m.ttft.labels(model).observe(req.first_token_at - req.arrival)
                if len(seq.output) > 1:
                    m.tpot.labels(model).observe((req.finished_at - req.first_token_at) / (len(seq.output) - 1))
        self._end_span(req, error)
        s = seq.stats
        log.info("request finished" if error is None else "request failed", extra={
            "request_id": req.request_id, "finish_reason": seq.finish_reason, "prompt_tokens": seq.prompt_len,
            "output_tokens": len(seq.output), "method": req.method, "k": req.kstate.k,
            "acceptance_rate": round(s.acceptance_rate, 4), "mean_accepted_length": round(s.mean_accepted_length, 4),
            "draft_errors": s.draft_errors, "latency_s": round(req.finished_at - req.arrival, 6),
            **({"error": error.message} if error else {})})
        req.events.put(Event("error", error=error) if error else Event("done", tokens or [], logprobs))
        with self._cond:
            req.done = True
            self._count -= 1
            self._reserved -= req.reserved_blocks
            self._cond.notify_all()

    def _finish_unstarted(self, req: Request, error: Rejected | None = None) -> None:
        """A request that leaves before it ran (cancelled in the queue, or refused by the engine)."""
        req.finished_at = time.perf_counter()
        if error is None:
            error = Rejected(grpc.StatusCode.CANCELLED, "cancelled while queued")
        if req.span is not None:
            req.span.set_attribute("error.type", error.code.name)
            req.span.end()
        req.events.put(Event("error", error=error))
        with self._cond:
            req.done = True
            self._count -= 1
            self._cond.notify_all()

    def _end_span(self, req: Request, error: Rejected | None) -> None:
        if req.span is None:
            return
        req.span.set_attributes(result_attributes(req))
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            req.span.set_attribute("error.type", error.code.name)
            req.span.set_status(Status(StatusCode.ERROR, error.message))
        req.span.end()

    def _fail_all(self, error: Rejected) -> None:
        for req in list(self._active):
            try:
                self.engine.abort(req.seq)
            except Exception:  # noqa: BLE001 - the engine may be what broke; the request is told anyway
                pass
            self._finish(req, error)
        with self._cond:
            pending, self._pending = list(self._pending), deque()
        for req in pending:
            self._finish_unstarted(req, error)

    def _publish_gauges(self) -> None:
        m, model = self.metrics, self.metrics.model
        m.running.labels(model).set(len(self._active))
        m.kv_blocks_used.labels(model).set(self.engine.cache.allocator.num_used)
        m.speedup.labels(model, m.quantization).set(self.speedup_ratio())
