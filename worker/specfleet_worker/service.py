"""The gRPC servicers: `specfleet.v1.Generation` and `specfleet.v1.Admin`.

Handlers validate (INVALID_ARGUMENT with the field's name), build a scheduler `Request`, submit it
and relay its events; they never touch the engine. A callback on the RPC cancels the request when
the caller cancels, disconnects or runs past its deadline.
"""

from __future__ import annotations

import logging
import math
import time
import uuid

import grpc
from opentelemetry import trace

from specfleet_engine.proposers import MixedProposer
from specfleet_engine.sampling import SamplingParams
from specfleet_api.enums import DEFAULT_TREE_BRANCHING, PROMPT_TYPES, Method
from specfleet_api.limits import MAX_REQUEST_ID, WIRE_DEFAULT_MAX_TOKENS, WIRE_DEFAULT_TEMPERATURE

from .config import AUTO, LiveConfig
from specfleet_proto import worker_pb2 as pb
from specfleet_proto import worker_pb2_grpc as pb_grpc
from .scheduler import Event, Refusal, Rejected, Request, Scheduler, ScoreJob
from .tracing import incoming_context, request_attributes, result_attributes

log = logging.getLogger("specfleet.worker")

DEFAULT_MAX_TOKENS = WIRE_DEFAULT_MAX_TOKENS
MAX_STOP_STRINGS = 8
MAX_STOP_LEN = 256
MAX_PROMPT_TYPE = 64
CHAT_ROLES = ("system", "user", "assistant")


STATUS = {
    Refusal.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Refusal.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Refusal.CANCELLED: grpc.StatusCode.CANCELLED,
    Refusal.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Refusal.FAILED: grpc.StatusCode.INTERNAL,
}


def end_span(span: trace.Span, req: Request, error: Rejected | None) -> None:
    """The request's span, closed with its results (or its error) when it leaves the scheduler."""
    if req.seq is not None:
        span.set_attributes(result_attributes(req))
    if error is not None:
        span.set_attribute("error.type", STATUS[error.kind].name)
        span.set_status(trace.Status(trace.StatusCode.ERROR, error.message))
    span.end()


class Invalid(ValueError):
    """A request field out of range; the message starts with the field's name."""


class Worker:
    """What the servicers share: the engine's scheduler, its limits, the live config, the tracer."""

    def __init__(self, scheduler: Scheduler, live: LiveConfig, *, model_name: str, quantization: str = "none",
                 role: str = "stable", tree_branching: int = DEFAULT_TREE_BRANCHING, max_tokens_limit: int = 2048,
                 max_request_bytes: int = 1 << 20, tracer: trace.Tracer | None = None):
        self.scheduler, self.live = scheduler, live
        self.engine = scheduler.engine
        self.tokenizer = self.engine.tokenizer
        self.model_name, self.quantization, self.role = model_name, quantization, role
        self.tree_branching = tree_branching  # the cap (GetConfig); the gauge reports what was verified
        self.max_tokens_limit, self.max_request_bytes = max_tokens_limit, max_request_bytes
        self.tracer = tracer or trace.NoOpTracer()
        self.vocab_size = self.engine.model.args.vocab_size
        # only the router's prompt types and those the operator routes become metric labels (and
        # fleet windows); the rest are "other", so a client cannot mint labels
        self.known_prompt_types = set(PROMPT_TYPES) | set(live.settings.by_prompt_type) | {"default"}

    # -- validation ---------------------------------------------------------------------------

    def _check_envelope(self, msg) -> None:
        size = msg.ByteSize()
        if size > self.max_request_bytes:
            raise Invalid(f"request: {size} bytes; the limit is {self.max_request_bytes}")
        if len(msg.request_id) > MAX_REQUEST_ID:
            raise Invalid(f"request_id: {len(msg.request_id)} characters; the limit is {MAX_REQUEST_ID}")

    def _check_params(self, params: SamplingParams) -> None:
        try:
            params.validate(self.max_tokens_limit)
        except ValueError as e:
            raise Invalid(str(e)) from None
        if not math.isfinite(params.temperature):
            raise Invalid(f"temperature must be finite, got {params.temperature}")

    @staticmethod
    def _deadline(context: grpc.ServicerContext | None) -> float | None:
        if context is not None and context.time_remaining() is not None:
            return time.monotonic() + context.time_remaining()
        return None

    def build_request(self, msg: pb.GenerateRequest, context: grpc.ServicerContext | None = None) -> Request:
        self._check_envelope(msg)
        if len(msg.prompt_type) > MAX_PROMPT_TYPE:
            raise Invalid(f"prompt_type: {len(msg.prompt_type)} characters; the limit is {MAX_PROMPT_TYPE}")
        prompt = self._prompt_ids(msg)
        if len(prompt) >= self.engine.max_len:
            raise Invalid(f"prompt: {len(prompt)} tokens; the context holds {self.engine.max_len} "
                          "(prompt and output together)")
        params = SamplingParams(
            max_tokens=msg.max_tokens if msg.HasField("max_tokens") else min(DEFAULT_MAX_TOKENS, self.max_tokens_limit),
            temperature=msg.temperature if msg.HasField("temperature") else WIRE_DEFAULT_TEMPERATURE,
            top_k=msg.top_k if msg.HasField("top_k") else 0,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            seed=msg.seed if msg.HasField("seed") else None,
            stop=list(msg.stop), logprobs=msg.logprobs, ignore_eos=msg.ignore_eos)
        self._check_params(params)
        if params.stop:
            if self.tokenizer is None:
                raise Invalid("stop: this worker's model has no tokenizer, so it cannot match stop strings")
            if len(params.stop) > MAX_STOP_STRINGS or max(map(len, params.stop)) > MAX_STOP_LEN:
                raise Invalid(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LEN} characters")
        settings = self.live.settings
        requested = msg.speculation_method
        if requested and requested != AUTO and requested not in self.live.methods:
            raise Invalid(f"speculation_method: unknown method {requested!r}; "
                          f"this worker has {', '.join(self.live.methods + [AUTO])}")
        prompt_type = msg.prompt_type if msg.prompt_type in self.known_prompt_types else (
            "default" if not msg.prompt_type else "other")
        method = settings.method_for(requested, msg.prompt_type, msg.probe)
        needed = self.scheduler.blocks_needed(len(prompt), params.max_tokens)
        if needed > self.engine.cache.allocator.num_blocks:
            raise Invalid(f"max_tokens: prompt and output need {needed} KV blocks; "
                          f"this worker's cache holds {self.engine.cache.allocator.num_blocks}")
        rid = msg.request_id or uuid.uuid4().hex
        return Request(rid, prompt, params, method, prompt_type, settings.k_initial if method != Method.NONE else 0,
                       self._deadline(context), probe=msg.probe)

    def build_score(self, msg: pb.ScoreRequest, context: grpc.ServicerContext | None = None) -> ScoreJob:
        """A scoring job from a ScoreRequest, validated as Generate's request is (Invalid naming the field)."""
        self._check_envelope(msg)
        prompt = self._prompt_ids(msg)
        if len(prompt) >= self.engine.max_len:
            raise Invalid(f"prompt: {len(prompt)} tokens; the context holds {self.engine.max_len} "
                          "(prompt and token_ids together)")
        tokens = list(msg.token_ids)
        if not tokens:
            raise Invalid("token_ids: empty; send the continuation to score")
        if len(tokens) > self.max_tokens_limit:
            raise Invalid(f"token_ids: {len(tokens)} tokens; the limit is {self.max_tokens_limit}")
        bad = next((i for i, t in enumerate(tokens) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise Invalid(f"token_ids[{bad}]: {tokens[bad]} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) + len(tokens) > self.engine.max_len:
            raise Invalid(f"token_ids: the prompt ({len(prompt)} tokens) and token_ids ({len(tokens)}) are "
                          f"{len(prompt) + len(tokens)} tokens; the context holds {self.engine.max_len}")
        params = SamplingParams(
            max_tokens=len(tokens), temperature=msg.temperature if msg.HasField("temperature") else WIRE_DEFAULT_TEMPERATURE,
            top_k=msg.top_k if msg.HasField("top_k") else 0, top_p=msg.top_p if msg.HasField("top_p") else 1.0)
        self._check_params(params)
        needed = self.scheduler.score_blocks(len(prompt) + len(tokens))
        if needed > self.engine.cache.allocator.num_blocks:
            raise Invalid(f"token_ids: the prompt and token_ids need {needed} KV blocks; "
                          f"this worker's cache holds {self.engine.cache.allocator.num_blocks}")
        return ScoreJob(msg.request_id or uuid.uuid4().hex, prompt, tokens, params, self._deadline(context))

    def _prompt_ids(self, msg: pb.GenerateRequest | pb.ScoreRequest) -> list[int]:
        given = [name for name, value in (("prompt", msg.prompt), ("prompt_token_ids", msg.prompt_token_ids),
                                          ("messages", msg.messages)) if len(value)]
        if len(given) > 1:
            raise Invalid(f"{', '.join(given)}: set exactly one of prompt, prompt_token_ids and messages")
        if not given:
            raise Invalid("prompt: empty; send prompt (text), prompt_token_ids or messages")
        if msg.prompt_token_ids:
            ids = list(msg.prompt_token_ids)
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise Invalid(f"prompt_token_ids[{bad}]: {ids[bad]} is outside the vocabulary [0, {self.vocab_size})")
            return ids
        if self.tokenizer is None:
            raise Invalid(f"{given[0]}: this worker's model has no tokenizer; send prompt_token_ids")
        if msg.messages:
            ids = self._render(msg.messages)
        else:
            ids = self.tokenizer.chat(msg.prompt) if msg.apply_chat_template else self.tokenizer.encode(msg.prompt)
        if not ids:
            raise Invalid(f"{given[0]}: encodes to no tokens")
        return ids

    def _render(self, messages) -> list[int]:
        """The conversation in the model's chat template, ready for the assistant's turn."""
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise Invalid(f"messages[{i}].role: {m.role!r} is not one of {', '.join(CHAT_ROLES)}")
        try:
            return self.tokenizer.chat_messages([{"role": m.role, "content": m.content} for m in messages])
        except ValueError as e:
            raise Invalid(f"messages: {e}") from None

    # -- running a request --------------------------------------------------------------------

    def run(self, msg: pb.GenerateRequest, context: grpc.ServicerContext):
        """Yields scheduler events for one request; aborts the RPC with the right status on errors."""
        try:
            req = self.build_request(msg, context)
        except Invalid as e:
            self.scheduler.count_rejection("invalid")
            log.info("request refused", extra={"request_id": msg.request_id, "error": str(e)})
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        span = self.tracer.start_span(f"text_completion {self.model_name}", kind=trace.SpanKind.SERVER,
                                      context=incoming_context(context.invocation_metadata()),
                                      attributes=request_attributes(self.model_name, req))
        req.on_finish = lambda r, error: end_span(span, r, error)
        try:
            self.scheduler.submit(req)
        except Rejected as e:
            span.set_attribute("error.type", STATUS[e.kind].name)
            span.end()
            context.abort(STATUS[e.kind], e.message)
        if not context.add_callback(lambda: self.scheduler.cancel(req)):
            self.scheduler.cancel(req)  # the RPC ended before the callback could be registered
        while True:
            ev: Event = req.events.get()
            if ev.kind == "error":
                context.abort(STATUS[ev.error.kind], ev.error.message)
            yield req, ev
            if ev.kind == "done":
                return

    def stats_message(self, seq, req: Request) -> pb.SpeculationStats:
        s = seq.stats
        return pb.SpeculationStats(
            method=req.method, num_steps=s.num_steps, num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens,
            num_accepted_tokens=s.num_accepted_tokens, accepted_per_position=s.accepted_per_position,
            acceptance_rate=s.acceptance_rate, mean_accepted_length=s.mean_accepted_length,
            draft_errors=s.draft_errors, final_k=seq.k if req.method != Method.NONE else 0,
            num_draft_nodes=s.num_draft_nodes, spec_plain_seconds=req.spec_seconds[0],
            spec_busy_seconds=req.spec_seconds[1])


class TextStream:
    """Incremental detokenisation: emits only text that later tokens cannot change.

    Holds back an incomplete UTF-8 character (decoded as U+FFFD) and, with stop strings, the
    last len(longest stop) - 1 characters, which a stop string may still swallow."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.sent = tokenizer, 0
        self.hold = max(map(len, stop), default=1) - 1

    def delta(self, ids: list[int], final_text: str | None = None) -> str:
        if self.tokenizer is None:
            return ""
        if final_text is not None:
            out, self.sent = final_text[self.sent:], len(final_text)
            return out
        text = self.tokenizer.decode(ids)
        end = len(text) - self.hold
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent:end], end
        return out


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, holder):
        self.holder = holder  # .worker is None while the model loads

    def _worker(self, context) -> Worker:
        worker = self.holder.worker
        if worker is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is loading its model; retry shortly")
        return worker

    def Generate(self, request, context):
        w = self._worker(context)
        req = None
        for req, _ in w.run(request, context):
            pass
        seq = req.seq
        return pb.GenerateResponse(
            request_id=req.request_id, text=w.engine.text_of(seq), token_ids=seq.output,
            logprobs=seq.logprobs if req.params.logprobs else [], finish_reason=seq.finish_reason,
            usage=pb.Usage(prompt_tokens=seq.prompt_len, completion_tokens=len(seq.output)),
            speculation=w.stats_message(seq, req),
            time_to_first_token_s=(req.first_token_at - req.arrival) if req.first_token_at else 0.0,
            latency_s=req.finished_at - req.arrival)

    def GenerateStream(self, request, context):
        w = self._worker(context)
        text = TextStream(w.tokenizer, list(request.stop))
        ids: list[int] = []  # what this stream has received; the sequence itself may be further on
        for req, ev in w.run(request, context):
            ids += ev.tokens or []
            if ev.kind == "tokens":
                yield pb.GenerateStreamResponse(request_id=req.request_id, token_ids=ev.tokens,
                                                logprobs=ev.logprobs or [], text=text.delta(ids))
            else:  # done: the sequence has finished, so reading it is safe
                seq = req.seq
                yield pb.GenerateStreamResponse(
                    request_id=req.request_id, token_ids=ev.tokens, logprobs=ev.logprobs or [],
                    text=text.delta(ids, w.engine.text_of(seq)), finish_reason=seq.finish_reason,
                    usage=pb.Usage(prompt_tokens=seq.prompt_len, completion_tokens=len(seq.output)),
                    speculation=w.stats_message(seq, req))


    def Score(self, request, context):
        w = self._worker(context)
        try:
            job = w.build_score(request, context)
        except Invalid as e:
            w.scheduler.count_rejection("invalid")
            log.info("scoring refused", extra={"request_id": request.request_id, "error": str(e)})
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            w.scheduler.submit_score(job)
        except Rejected as e:
            context.abort(STATUS[e.kind], e.message)
        if not context.add_callback(lambda: w.scheduler.cancel(job)):
            w.scheduler.cancel(job)
        job.finished.wait()  # the scheduler ends every job it took (stopping included)
        if job.error is not None:
            context.abort(STATUS[job.error.kind], job.error.message)
        return pb.ScoreResponse(request_id=job.request_id, logprobs=job.logprobs, prompt_tokens=len(job.context))


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, holder):
        self.holder = holder

    def _worker(self, context) -> Worker:
        worker = self.holder.worker
        if worker is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is loading its model; retry shortly")
        return worker

    def _config(self, w: Worker) -> pb.WorkerConfig:
        s = w.live.settings
        guard = getattr(w.engine.k_policy, "max_slowdown", None)
        corpus = getattr(w.engine.proposers.get(Method.NGRAM.value), "corpus", None)
        shape = w.engine.tree_shape
        paths = sorted(shape.paths, key=lambda p: (len(p), p)) if shape is not None else []
        return pb.WorkerConfig(
            model=w.model_name, quantization=w.quantization, role=w.role, speculation_enabled=s.speculation_enabled,
            default_speculate=s.default_speculate,
            k_min=s.k_min, k_max=s.k_max, k_initial=s.k_initial, k_policy=s.k_policy, default_method=s.default_method,
            method_by_prompt_type=s.by_prompt_type, methods=w.live.methods,
            max_batch_size=w.scheduler.max_batch_size, max_queue=w.scheduler.max_queue,
            max_tokens_limit=w.max_tokens_limit, context_length=w.engine.max_len, tree_branching=w.tree_branching,
            latency_guard_percent=round(guard * 100) if guard else 0, ngram_corpus_tokens=corpus.capacity if corpus else 0,
            device=str(w.engine.device), tree_choices=[pb.TreePath(ranks=p) for p in paths],
            ngram_mix=any(isinstance(p, MixedProposer) for p in w.engine.proposers.values()))

    def GetConfig(self, request, context):
        return self._config(self._worker(context))

    def UpdateConfig(self, request, context):
        w = self._worker(context)
        try:
            w.live.update(
                speculation_enabled=request.speculation_enabled if request.HasField("speculation_enabled") else None,
                k_min=request.k_min if request.HasField("k_min") else None,
                k_max=request.k_max if request.HasField("k_max") else None,
                default_method=request.default_method if request.HasField("default_method") else None,
                by_prompt_type=dict(request.method_by_prompt_type))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        w.known_prompt_types |= set(w.live.settings.by_prompt_type)
        return self._config(w)

    def GetStats(self, request, context):
        w = self._worker(context)
        sch, m = w.scheduler, w.scheduler.metrics

        return pb.WorkerStats(
            queue_depth=sch.queue_depth(), running=sch.running(), kv_blocks_used=w.engine.cache.allocator.num_used,
            kv_blocks_total=w.engine.cache.allocator.num_blocks, requests_total=sch.requests_total,
            rejected_total=sch.rejected_total, failed_total=sch.failed_total, num_drafts=m.totals["num_drafts"],
            num_draft_tokens=m.totals["num_draft_tokens"], num_accepted_tokens=m.totals["num_accepted_tokens"],
            acceptance_rate=m.window.rate, mean_accepted_length=m.window.tau,
            speedup_ratio=sch.speedup_ratio(),
            acceptance_rate_by_prompt_type={t: wr.rate for t, wr in list(m.window_by_type.items())},
            ready=self.holder.ready, draining=sch.draining, draft_errors=m.totals["draft_errors"],
            num_draft_nodes=m.totals["num_draft_nodes"])
