"""The scheduler thread: the only code that touches the engine.

gRPC handlers `submit` a `Request` and read its `events` queue; the thread admits queued requests
into the running batch at step boundaries (bounded by batch size and by KV blocks reserved for
each request's worst case, so a step never runs out of blocks), applies cancellations and
deadlines (the sequence's KV blocks are freed before the next step), sets each request's K from
the live bounds (the engine's K policy chooses K within them), runs `engine.step()`, and
routes the new tokens back. Scoring jobs (`submit_score`: teacher-forced log-probabilities) run
on the same thread between two steps, in KV blocks reserved as a request's are.
Admission is decided in `submit`, under the lock: beyond `max_batch_size + max_queue` requests
and scoring jobs in the worker, an `OVERLOADED` refusal at once.

It knows nothing of gRPC or OpenTelemetry: refusals carry a `Refusal` kind that the service maps
to a status code, and a request's `on_finish` hook (the service ends its span there) is called
once when it leaves, on the scheduler thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from specfleet_api.limits import MAX_DRAFT_NODES
from specfleet_engine.acceptance import Acceptance, window
from specfleet_engine.engine import Engine, Sequence
from specfleet_engine.sampling import SamplingParams

from .config import LiveConfig
from .metrics import Metrics

log = logging.getLogger("specfleet.worker")


class Refusal(Enum):
    """Why a request was refused or failed; the service maps each to its transport's status."""

    INVALID = "invalid"  # the request cannot be served as asked
    OVERLOADED = "overloaded"  # the worker is full: retry later or elsewhere
    UNAVAILABLE = "unavailable"  # the worker is shutting down or stopped
    CANCELLED = "cancelled"  # the caller went away before it ran
    DEADLINE = "deadline"  # the caller's deadline passed
    FAILED = "failed"  # the engine failed while running it


# the worker's own failures (a window's `errors`), not the caller's doing nor a refusal at the door
FAILURES = (Refusal.FAILED, Refusal.UNAVAILABLE)


class Rejected(Exception):
    """A request refused before or while running; `kind` says why."""

    def __init__(self, kind: Refusal, message: str):
        super().__init__(message)
        self.kind, self.message = kind, message


@dataclass
class Event:
    kind: str  # "tokens" | "done" | "error"
    tokens: list[int] | None = None
    logprobs: list[float] | None = None
    error: Rejected | None = None


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, method: str,
                 prompt_type: str, k_initial: int, deadline: float | None = None,
                 on_finish: Callable[[Request, Rejected | None], None] | None = None, probe: bool = False):
        self.request_id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.method, self.prompt_type, self.deadline = method, prompt_type, deadline
        self.probe = probe  # the router's probe: speculates through a soft off
        self.k_initial = k_initial
        self.on_finish = on_finish  # called once, on the scheduler thread, when the request leaves
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.k_sum = self.k_steps = 0
        self.seq: Sequence | None = None
        self.speculating = False  # speculation is in effect for its next step
        self.speculated = False  # it was for at least one step
        self.spec_seconds = (0.0, 0.0)  # (plain-equivalent, actual) of its steps that speculated
        self.cancelled = False
        self.done = False
        self.reserved_blocks = 0
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._sent_logprobs = 0
        self._draft_errors = 0


class ScoreJob:
    """Teacher-forced scoring of `tokens` after `context` (Engine.score); `finished` is set once
    `logprobs` or `error` is."""

    def __init__(self, request_id: str, context: list[int], tokens: list[int], params: SamplingParams,
                 deadline: float | None = None):
        self.request_id, self.context, self.tokens, self.params = request_id, context, tokens, params
        self.deadline = deadline
        self.reserved_blocks = 0
        self.cancelled = False
        self.logprobs: list[float] | None = None
        self.error: Rejected | None = None
        self.done = False
        self.finished = threading.Event()


class Scheduler:
    def __init__(self, engine: Engine, live: LiveConfig, metrics: Metrics, *, max_batch_size: int = 16,
                 max_queue: int = 64, idle_wait_s: float = 0.5):
        self.engine, self.live, self.metrics = engine, live, metrics
        self.max_batch_size, self.max_queue, self.idle_wait_s = max_batch_size, max_queue, idle_wait_s
        self._cond = threading.Condition()
        self._pending: deque[Request] = deque()
        self._scoring: deque[ScoreJob] = deque()
        self._active: list[Request] = []  # the running batch; only the scheduler thread touches it
        self._count = 0  # pending + running, under the lock: what admission counts
        self._reserved = 0  # KV blocks reserved by the running batch
        # prompt type -> acceptance over its recent verify steps: a new request's prior
        self._by_type: dict[str, Acceptance] = {}
        self.speedup = SpeedupMeter()
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
        """KV blocks a request may hold at worst: its whole context plus a full draft (chain or tree)."""
        tokens = min(prompt_len + max_tokens, self.engine.max_len) + MAX_DRAFT_NODES + 1
        return -(-tokens // self.engine.cache.block_size)

    def submit(self, req: Request) -> None:
        """Queues the request, or raises Rejected (UNAVAILABLE while draining, RESOURCE_EXHAUSTED when full)."""
        req.reserved_blocks = self.blocks_needed(len(req.prompt_ids), req.params.max_tokens)
        with self._cond:
            self._admit()
            self._pending.append(req)
            self.metrics.queue_depth.labels(self.metrics.model).set(len(self._pending))
            self._cond.notify()

    def score_blocks(self, tokens: int) -> int:
        """KV blocks a scoring job of this many tokens (context and continuation) holds."""
        return -(-tokens // self.engine.cache.block_size)

    def submit_score(self, job: ScoreJob) -> None:
        """Queues a scoring job, run between two steps; Rejected as `submit`."""
        job.reserved_blocks = self.score_blocks(len(job.context) + len(job.tokens))
        with self._cond:
            self._admit()
            self._scoring.append(job)
            self._cond.notify()

    def _admit(self) -> None:
        """Counts one more in the worker, or raises Rejected; under the lock."""
        if self.draining or self._stopped or not self.alive:
            self.count_rejection("draining")
            raise Rejected(Refusal.UNAVAILABLE, "the worker is shutting down; send the request elsewhere")
        limit = self.max_batch_size + self.max_queue
        if self._count >= limit:
            self.count_rejection("overload")
            raise Rejected(Refusal.OVERLOADED,
                           f"the worker is full: {self._count} requests running or queued, the limit is {limit}")
        self._count += 1

    def cancel(self, req: Request | ScoreJob) -> None:
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

    def refuse(self) -> None:
        """New requests refused from now on (UNAVAILABLE); those in flight go on."""
        with self._cond:
            self.draining = True

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
        return self.speedup.ratio()

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
            self._fail_all(Rejected(Refusal.UNAVAILABLE, "the worker stopped before the request finished"))

    def _iterate(self) -> bool:
        admit: list[Request] = []
        scores: list[ScoreJob] = []
        with self._cond:
            while not self._pending and not self._active and not self._scoring and not self._stopped:
                self._cond.wait(self.idle_wait_s)
            if self._stopped:
                return False
            now = time.monotonic()
            for req in [r for r in self._pending if r.cancelled or (r.deadline is not None and now > r.deadline)]:
                self._pending.remove(req)
                self._finish_unstarted(req)
            capacity = self.engine.cache.allocator.num_blocks
            for job in list(self._scoring):  # the jobs whose blocks are free now, in order
                if job.cancelled or (job.deadline is not None and now > job.deadline):
                    self._scoring.remove(job)
                    self._end_score(job, Rejected(Refusal.CANCELLED, "cancelled while queued") if job.cancelled
                                    else Rejected(Refusal.DEADLINE, "the request's deadline passed"))
                elif self._reserved + job.reserved_blocks <= capacity:
                    self._scoring.remove(job)
                    self._reserved += job.reserved_blocks
                    scores.append(job)
            while (self._pending and len(self._active) + len(admit) < self.max_batch_size
                   and self._reserved + self._pending[0].reserved_blocks <= capacity):
                req = self._pending.popleft()
                self._reserved += req.reserved_blocks
                admit.append(req)
            if self._pending and not self._active and not admit:  # could never fit (the service checks first)
                req = self._pending.popleft()
                self._finish_unstarted(req, Rejected(Refusal.INVALID,
                                                     f"max_tokens: the request needs {req.reserved_blocks} KV blocks, "
                                                     f"the cache holds {capacity}"))
            self.metrics.queue_depth.labels(self.metrics.model).set(len(self._pending))
        now = time.monotonic()
        for req in [r for r in self._active if r.cancelled or (r.deadline is not None and now > r.deadline)]:
            self.engine.abort(req.seq)  # frees its KV blocks now
            self._finish(req, None if req.cancelled else Rejected(Refusal.DEADLINE, "the request's deadline passed"))
        for job in scores:
            self._score(job)
        for req in admit:
            self._start(req)
        if not self._active:
            self._publish_gauges()
            return True
        self._set_bounds()
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
                self._finish(req, Rejected(Refusal.FAILED, f"the engine failed: {type(e).__name__}: {e}"))
            return True
        plain, actual = self.speedup.observe(self.engine, time.perf_counter() - t0)
        self.metrics.busy(plain, actual)
        self._route(outputs, self.speedup.shares(self.engine, actual, outputs))
        self._publish_gauges()
        return True

    def _score(self, job: ScoreJob) -> None:
        """One scoring job, between two steps: the running batch waits one forward."""
        error = None
        try:
            job.logprobs = self.engine.score(job.context, job.tokens, job.params)
        except ValueError as e:  # the service validates first; this is the engine's last word
            error = Rejected(Refusal.INVALID, str(e))
        except Exception as e:  # noqa: BLE001 - fail the job, keep the worker serving
            log.exception("scoring failed", extra={"request_id": job.request_id})
            error = Rejected(Refusal.FAILED, f"the engine failed: {type(e).__name__}: {e}")
        with self._cond:
            self._reserved -= job.reserved_blocks
        self._end_score(job, error)

    def _end_score(self, job: ScoreJob, error: Rejected | None) -> None:
        job.error = error
        log.info("scored" if error is None else "scoring failed", extra={
            "request_id": job.request_id, "prompt_tokens": len(job.context), "tokens": len(job.tokens),
            **({"error": error.message} if error else {})})
        with self._cond:
            job.done = True
            self._count -= 1
            self._cond.notify_all()
        job.finished.set()

    def _start(self, req: Request) -> None:
        s = self.live.settings
        history = self._by_type.get(req.prompt_type)
        prior = history.alpha if history is not None and history.steps >= 16 else None
        k_min, k_max = s.k_bounds(req.prompt_type)
        try:
            req.seq = self.engine.add(req.prompt_ids, req.params, req.method, req.k_initial, req.request_id,
                                      k_min=k_min, k_max=k_max, prior=prior, batch=len(self._active) + 1)
        except ValueError as e:  # the service validates first; this is the engine's last word
            with self._cond:
                self._reserved -= req.reserved_blocks
            self._finish_unstarted(req, Rejected(Refusal.INVALID, str(e)))
            return
        self._active.append(req)
        self.metrics.prompt_tokens.labels(self.metrics.model).inc(len(req.prompt_ids))

    def _set_bounds(self) -> None:
        """The live K bounds (under its prompt type's ceiling), applied to every running request
        (the K policy keeps K within); 0 for those that may not draft now (speculation off, hard
        or soft: config.Settings)."""
        s = self.live.settings
        for req in self._active:
            seq = req.seq
            if s.drafts(req.method, req.probe):
                seq.k_min, seq.k_max = s.k_bounds(req.prompt_type)
            else:
                seq.k_min = seq.k_max = 0
            req.speculating = seq.k_max > 0
            req.speculated |= req.speculating

    def _route(self, outputs, shares: list[tuple[float, float]]) -> None:
        by_id = {r.seq.seq_id: r for r in self._active}
        now = time.perf_counter()
        for out, (plain_s, actual_s) in zip(outputs, shares):
            req = by_id.get(out.seq.seq_id)
            if req is None:
                continue
            self.metrics.cost(req.prompt_type, plain_s, actual_s, spec=req.speculating, method=req.method)
            if req.speculating:
                req.spec_seconds = (req.spec_seconds[0] + plain_s, req.spec_seconds[1] + actual_s)
            seq = out.seq
            if out.stats is None:  # the prefill's first token
                req.first_token_at = now
                self.metrics.generation_tokens.labels(self.metrics.model).inc(len(out.new_tokens))
            else:
                st = out.stats
                req.k_sum += seq.k
                req.k_steps += 1
                if st.num_draft_tokens:
                    self._by_type.setdefault(req.prompt_type, window(256, weight=1.0, recover=0.0)).observe(
                        st.draft_positions, st.num_accepted)
                self.metrics.step(req.prompt_type, seq.k, st.num_draft_tokens, st.num_accepted, st.num_emitted,
                                  st.draft_depth, st.ngram_nodes, st.ngram_accepted, method=req.method)
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

    def _finish(self, req: Request, error: Rejected | None = None, tokens: list[int] | None = None,
                logprobs: list[float] | None = None) -> None:
        if req in self._active:
            self._active.remove(req)
        seq = req.seq
        if req.cancelled and seq.finish_reason != "abort":
            seq.finish_reason = "abort"
        req.finished_at = time.perf_counter()
        if error is None:
            self.requests_total += 1
            ttft = tpot = None
            if req.first_token_at is not None:
                ttft = req.first_token_at - req.arrival
                if len(seq.output) > 1:
                    tpot = (req.finished_at - req.first_token_at) / (len(seq.output) - 1)
            self.metrics.finished(req.prompt_type, seq.finish_reason, len(seq.output), req.finished_at - req.arrival,
                                  ttft, tpot, spec=req.speculated, spec_seconds=req.spec_seconds,
                                  method=req.method,
                                  spec_alpha=seq.stats.acceptance_rate if seq.stats.num_draft_tokens else None)
        elif error.kind in FAILURES:
            self.metrics.error(req.prompt_type, req.method)
        self._hook(req, error)
        s = seq.stats
        log.info("request finished" if error is None else "request failed", extra={
            "request_id": req.request_id, "finish_reason": seq.finish_reason, "prompt_tokens": seq.prompt_len,
            "output_tokens": len(seq.output), "method": req.method, "k": seq.k,
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
            error = Rejected(Refusal.CANCELLED, "cancelled while queued")
        if error.kind in FAILURES:
            self.metrics.error(req.prompt_type, req.method)
        self._hook(req, error)
        req.events.put(Event("error", error=error))
        with self._cond:
            req.done = True
            self._count -= 1
            self._cond.notify_all()

    @staticmethod
    def _hook(req: Request, error: Rejected | None) -> None:
        if req.on_finish is not None:
            try:
                req.on_finish(req, error)
            except Exception:  # noqa: BLE001 - a hook's failure must not fail the request
                log.exception("on_finish hook failed", extra={"request_id": req.request_id})

    def _fail_all(self, error: Rejected) -> None:
        for req in list(self._active):
            try:
                self.engine.abort(req.seq)
            except Exception:  # noqa: BLE001 - the engine may be what broke; the request is told anyway
                pass
            self._finish(req, error)
        with self._cond:
            pending, self._pending = list(self._pending), deque()
            scoring, self._scoring = list(self._scoring), deque()
        for req in pending:
            self._finish_unstarted(req, error)
        for job in scoring:
            self._end_score(job, error)

    def _publish_gauges(self) -> None:
        m, model = self.metrics, self.metrics.model
        m.running.labels(model).set(len(self._active))
        m.kv_blocks_used.labels(model).set(self.engine.cache.allocator.num_used)
        m.speedup.labels(model, m.quantization).set(self.speedup_ratio())


class SpeedupMeter:
    """Speculation's speed-up over plain decoding, priced by the engine's one step-cost model.

    For each step: its wall time, and what plain decoding would have taken for the same work.
    Prefills and the time around the engine count the same in both. The decoding part is
    re-priced: plain decoding emits one token per sequence per step, so the E tokens that B
    sequences emitted would have taken E / B plain steps, each costing a forward over B rows
    (this step's forward scaled by the calibrated cost of B rows over that of the rows it ran:
    the level, and so the machine's momentary load, cancels) plus the step's own work outside
    its forward and proposing (sampling, bookkeeping). The gauge is the ratio over a window of recent steps; the two running totals
    are exported too, so rate(plain) / rate(actual) gives it over any window.
    """

    def __init__(self, size: int = 512):
        self.window: deque[tuple[float, float]] = deque(maxlen=size)
        self._sums = (0.0, 0.0)  # the window's (plain, actual); one tuple so other threads read it whole
        self.total_plain = self.total_actual = 0.0

    def observe(self, engine: Engine, elapsed: float) -> tuple[float, float]:
        """(plain-decoding seconds, actual seconds) of the step that just ran."""
        t = engine.last_timing
        plain = elapsed
        if t.decode_seqs:
            plain += t.emitted * self.plain_token_seconds(engine) - t.decode
        plain = max(plain, 0.0)
        self.add(plain, elapsed)
        return plain, elapsed

    @staticmethod
    def plain_token_seconds(engine: Engine) -> float:
        """What plain decoding would pay per token for the decoding part of the step that just ran:
        one forward over its B sequences plus the step's work outside its forward and proposing
        (verification, bookkeeping), for B tokens."""
        t = engine.last_timing
        outside = max(t.decode - t.forward - t.propose, 0.0)
        # the forward plain decoding would run, at this step's own speed: the calibrated shape
        # prices B rows against the rows that ran, so contention hits both sides alike
        forward = t.forward * engine.costs(t.decode_seqs) / engine.costs(t.decode_rows)
        return (forward + outside) / t.decode_seqs

    @classmethod
    def shares(cls, engine: Engine, elapsed: float, outputs) -> list[tuple[float, float]]:
        """The step that just ran as (plain, actual) seconds per sequence, in the order of `outputs`
        (what the per-prompt-type costs add up). A sequence pays an equal part of the prefill or of
        the decoding part, whichever it was in, and of the time around both; on the plain side a
        decoding sequence pays for its own emitted tokens at `plain_token_seconds`. The parts add
        up to the step's two sides in `observe` (before its floor at 0)."""
        t = engine.last_timing
        prefilled = sum(1 for out in outputs if out.stats is None)
        around = max(elapsed - t.prefill - t.decode, 0.0) / max(len(outputs), 1)
        token = cls.plain_token_seconds(engine) if t.decode_seqs else 0.0
        out = []
        for o in outputs:
            if o.stats is None:  # prefilled in this step
                actual = t.prefill / prefilled + around
                out.append((actual, actual))
            else:
                out.append((o.stats.num_emitted * token + around, t.decode / t.decode_seqs + around))
        return out

    def add(self, plain: float, actual: float) -> None:
        p, a = self._sums
        if len(self.window) == self.window.maxlen:
            old_p, old_a = self.window[0]
            p, a = p - old_p, a - old_a
        self.window.append((plain, actual))
        self._sums = (p + plain, a + actual)
        self.total_plain += plain
        self.total_actual += actual

    def ratio(self) -> float:
        plain, actual = self._sums
        return plain / actual if actual > 0 else 1.0
