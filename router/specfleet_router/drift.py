"""Output drift, for the canary analysis: a share of requests is mirrored in the background to a
second backend, and the two answers compared. Speculation is lossless, so two backends that run
the same model answer a greedy request with the same tokens; a canary that does not has a bug or
another model.

While the live state names a drift epoch (a canary run) and a mirror share, a request whose
mirror draw falls under the share, once the client has its answer, makes two pairs:

- "canary": the stable answer against the canary's (the client's answer is one of them; the other
  arm answers the mirror);
- "control": the stable answer against another stable backend's (the same backend when there is
  only one), the baseline any disagreement is judged against.

A greedy request (temperature under 1e-5 or unset: specfleet_api.limits.is_greedy, the worker's own
test) is compared token for token: a pair agrees when the ids are identical, and the epoch keeps
its first difference (request id, position, the two tokens). A sampled request cannot be compared
that way: the client's tokens are scored teacher-forced (Generation.Score) on both sides, and the
per-token log-probability differences (second side minus first: canary minus stable) summed for
the loop's two-sample test.

Mirrored answers never reach the client and never delay it: at most `concurrency` pairs run at a
time, and a pair beyond that is dropped (counted). The counts of the current epoch are what the
router publishes (specfleet_api.windows.drift_key); a new epoch starts them at zero.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random

import grpc

from specfleet_api.limits import MAX_REQUEST_ID, is_greedy
from specfleet_api.windows import DRIFT_KINDS, DriftCounts
from specfleet_proto import worker_pb2 as pb

from .backends import Backend, Backends
from .dispatch import draw
from .metrics import RouterMetrics
from .split import CANARY, STABLE
from .state import StateSource

log = logging.getLogger("specfleet.router.drift")

DEFAULT_CONCURRENCY = 4
DEFAULT_TIMEOUT_S = 60.0


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token sequences differ (a shorter one differs where it ends);
    None when they are identical.

    >>> first_difference([1, 2, 3], [1, 2, 3]), first_difference([1, 2, 3], [1, 5, 3]), first_difference([1, 2], [1, 2, 3])
    (None, 1, 2)
    """
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logprob_differences(first: list[float], second: list[float]) -> list[float]:
    """second - first per token, where both are finite (a token top-k / top-p excluded on one side
    says nothing a difference could measure).

    >>> logprob_differences([-1.0, -2.0, float("-inf")], [-1.5, -2.0, -3.0])
    [-0.5, 0.0]
    """
    return [y - x for x, y in zip(first, second) if math.isfinite(x) and math.isfinite(y)]


def greedy(msg: pb.GenerateRequest) -> bool:
    return is_greedy(msg.temperature if msg.HasField("temperature") else None)


class Drift:
    """The mirroring and the counts of the current epoch, per kind."""

    def __init__(self, backends: Backends, state: StateSource, metrics: RouterMetrics, *,
                 concurrency: int = DEFAULT_CONCURRENCY, timeout_s: float = DEFAULT_TIMEOUT_S):
        if concurrency < 0:
            raise ValueError(f"mirror concurrency: need 0 or more pairs at a time, got {concurrency}")
        self.backends, self.state, self.metrics = backends, state, metrics
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.epoch = ""
        self.counts: dict[str, DriftCounts] = {}
        self.running = 0
        self.tasks: set[asyncio.Task] = set()

    def current(self) -> dict[str, DriftCounts]:
        """{kind: counts} of the epoch in force ({} when none); a new epoch starts from zero."""
        epoch = self.state.current.drift_epoch
        if epoch != self.epoch:
            self.epoch, self.counts = epoch, {}
        if not epoch:
            return {}
        return {kind: self.counts.get(kind, DriftCounts(epoch)) for kind in DRIFT_KINDS}

    def _add(self, epoch: str, kind: str, counts: DriftCounts) -> None:
        self.current()
        if epoch != self.epoch:  # a pair that began under the last canary run is not this one's evidence
            return
        self.counts[kind] = self.counts.get(kind, DriftCounts(epoch)).plus(counts)

    def offer(self, route, msg: pb.GenerateRequest, token_ids: list[int], request_id: str) -> None:
        """A request the client has its whole answer to: mirrored when its draw says so. Never waits."""
        state = self.state.current
        if not state.drift_epoch or state.mirror_share <= 0 or not token_ids:
            return
        d = draw(request_id, "mirror") if request_id else random.random() * 100.0
        if d >= state.mirror_share:
            return
        msg = _copy(msg)
        msg.prompt_type = route.prompt_type  # a gRPC caller may have left it to the router
        for kind in DRIFT_KINDS:
            if self.running >= self.concurrency:
                self.metrics.drift_dropped.labels(kind, "busy").inc()
                continue
            self.running += 1
            task = asyncio.get_running_loop().create_task(
                self._pair(kind, state.drift_epoch, route, msg, token_ids, request_id), name=f"mirror-{kind}")
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _pair(self, kind: str, epoch: str, route, msg, token_ids: list[int], request_id: str) -> None:
        try:
            sides = self._sides(kind, route)
            if sides is None:
                self.metrics.drift_dropped.labels(kind, "no_backend").inc()
                return
            if greedy(msg):
                a, b = [token_ids if s == "client" else await self._generate(s, msg, len(token_ids), request_id, kind)
                        for s in sides]
                pos = first_difference(a, b)
                diff = None if pos is None else {
                    "request_id": request_id, "position": pos,
                    "a": a[pos] if pos < len(a) else None, "b": b[pos] if pos < len(b) else None}
                self._add(epoch, kind, DriftCounts(epoch, pairs=1, agree=int(pos is None), first_diff=diff))
                self.metrics.drift_pairs.labels(kind, "agree" if pos is None else "differ").inc()
            else:
                first, second = [await self._score(s if s != "client" else self._served(route), msg, token_ids,
                                                   request_id, kind) for s in sides]
                diffs = logprob_differences(first, second)
                self._add(epoch, kind, DriftCounts(epoch, scored=1, logprob_diff_sum=sum(diffs),
                                                   logprob_diff_sq_sum=sum(x * x for x in diffs),
                                                   logprob_tokens=len(diffs)))
                self.metrics.drift_pairs.labels(kind, "scored").inc()
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, _NoBackend) as e:
            self.metrics.drift_dropped.labels(kind, "error").inc()
            log.info("mirror failed", extra={"kind": kind, "request_id": request_id, "error": str(e)})
        finally:
            self.running -= 1

    def _sides(self, kind: str, route) -> tuple | None:
        """The two answers of a pair, stable first: "client" (the client's own answer) or a backend
        to mirror to. None when an arm the pair needs has no ready backend."""
        exclude = [b for b in self.backends.pools[route.arm].backends if b.target == route.backend]
        t = route.prompt_type
        if kind == "canary":
            other = self._pick(CANARY if route.arm == STABLE else STABLE, (), t)
            if other is None:
                return None
            return ("client", other) if route.arm == STABLE else (other, "client")
        if route.arm == STABLE:
            b = self._pick(STABLE, exclude, t) or self._pick(STABLE, (), t)
            return None if b is None else ("client", b)
        a = self._pick(STABLE, (), t)
        b = a and (self._pick(STABLE, [a], t) or a)
        return None if a is None else (a, b)

    def _served(self, route) -> Backend | None:
        """Where the client's tokens are scored: the backend that generated them while it is still
        available, else another of its arm."""
        pool = self.backends.pools[route.arm]
        now = pool.clock()
        return next((b for b in pool.backends if b.target == route.backend and b.available(now)), None) \
            or self._pick(route.arm, (), route.prompt_type)

    def _pick(self, arm: str, exclude, prompt_type: str | None = None) -> Backend | None:
        """A backend of the arm, one that serves the method the arm's table names for the type
        where backends serve one method each (vLLM pools), else its plain pool."""
        pool = self.backends.pools[arm]
        method = self.state.current.method_for(prompt_type, arm) if prompt_type else None
        return pool.pick(list(exclude), method) or pool.pick(list(exclude), "none")

    def _mirror_id(self, request_id: str, kind: str) -> str:
        suffix = f"~mirror-{kind}"
        return request_id[:MAX_REQUEST_ID - len(suffix)] + suffix

    async def _generate(self, b: Backend, msg: pb.GenerateRequest, n: int, request_id: str, kind: str) -> list[int]:
        """The backend's answer to the same request, as long as the client's (longer says nothing more)."""
        out = _copy(msg)
        out.request_id = self._mirror_id(request_id, kind)
        out.max_tokens = n
        out.speculation_method = self.state.current.method_for(msg.prompt_type, b.arm)
        self.backends.acquire(b)
        try:
            resp = await b.generation.Generate(out, timeout=self.timeout_s)
        finally:
            self.backends.release(b)
        return list(resp.token_ids)

    async def _score(self, b: Backend | None, msg: pb.GenerateRequest, token_ids: list[int], request_id: str,
                     kind: str) -> list[float]:
        """The log-probabilities of the client's tokens under a backend's model, teacher-forced, with
        the request's sampling settings."""
        if b is None:
            raise _NoBackend("no ready backend to score on")
        req = pb.ScoreRequest(request_id=self._mirror_id(request_id, kind), prompt=msg.prompt,
                              prompt_token_ids=msg.prompt_token_ids, apply_chat_template=msg.apply_chat_template,
                              messages=msg.messages, token_ids=token_ids)
        for name in ("temperature", "top_k", "top_p"):
            if msg.HasField(name):
                setattr(req, name, getattr(msg, name))
        self.backends.acquire(b)
        try:
            resp = await b.generation.Score(req, timeout=self.timeout_s)
        finally:
            self.backends.release(b)
        return list(resp.logprobs)

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class _NoBackend(Exception):
    pass


def _copy(msg: pb.GenerateRequest) -> pb.GenerateRequest:
    out = pb.GenerateRequest()
    out.CopyFrom(msg)
    return out
