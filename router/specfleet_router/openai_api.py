"""OpenAI's request and response shapes, and nothing else: a JSON body in, a checked `Job` out
(or `BadRequest` naming the field), and the completion, chunk and error objects back.

What the worker cannot do is refused here with a 400 that says so (n > 1, tools, penalties);
fields OpenAI has that change nothing here (`user` aside, which picks the arm) are accepted.
The worker returns the log-probability of the chosen token only, so `top_logprobs` lists hold
that one token; tokens are named `token_id:<id>` (vLLM's convention when a server returns
token ids), since the router has no tokenizer.

>>> job = parse_chat({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})
>>> job.max_tokens, job.messages, job.prompt_type.value
(5, [{'role': 'user', 'content': 'Hi'}], 'chat')
>>> parse_chat({"model": "m", "messages": [], "n": 2})
Traceback (most recent call last):
...
specfleet_router.openai_api.BadRequest: messages: must be a non-empty list of messages
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from specfleet_api.enums import PromptType
from specfleet_api.limits import (INT32_MAX, INT64_MAX, INT64_MIN, MAX_HEADER_BYTES, MAX_JSON_DEPTH,
                                   OPENAI_DEFAULT_TEMPERATURE)
from specfleet_proto import worker_pb2 as pb

from .classify import classify, classify_messages

ROLES = ("system", "developer", "user", "assistant")
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions' `logprobs`
MAX_TOP_LOGPROBS = 20  # and for chat's `top_logprobs`
# fields a client may send that would change the output in ways the worker cannot honour
_UNSUPPORTED_UNLESS_EMPTY = ("tools", "functions", "tool_choice", "function_call", "logit_bias", "suffix",
                             "audio", "prediction")
_UNSUPPORTED_UNLESS_ZERO = ("presence_penalty", "frequency_penalty")


class BadRequest(ValueError):
    """A 400: `param` is the request field at fault (OpenAI's error `param`), the message starts
    with it."""

    def __init__(self, param: str | None, message: str):
        super().__init__(f"{param}: {message}" if param and not message.startswith(param) else message)
        self.prompt_type: PromptType | None = None  # set when the request got as far as being classified
        self.param = param


@dataclass
class Job:
    """One checked request, as the router forwards it."""

    kind: str  # "chat" | "completion"
    model: str
    prompt_type: PromptType
    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    temperature: float = OPENAI_DEFAULT_TEMPERATURE
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    user: str | None = None

    def to_proto(self, request_id: str) -> pb.GenerateRequest:
        msg = pb.GenerateRequest(request_id=request_id, temperature=self.temperature, stop=self.stop,
                                 logprobs=self.logprobs, ignore_eos=self.ignore_eos,
                                 prompt_type=self.prompt_type.value)
        if self.messages is not None:
            msg.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in self.messages)
        elif self.prompt_token_ids is not None:
            msg.prompt_token_ids.extend(self.prompt_token_ids)
        else:
            msg.prompt = self.prompt
        for name in ("max_tokens", "top_p", "top_k", "seed"):
            value = getattr(self, name)
            if value is not None:
                setattr(msg, name, value)
        return msg

    def param_for(self, worker_field: str | None) -> str | None:
        """The OpenAI field behind a worker's field name (for a 400 the worker raised)."""
        if worker_field in ("prompt", "prompt_token_ids", "messages"):
            return "messages" if self.kind == "chat" else "prompt"
        if worker_field == "max_tokens":
            return self.max_tokens_param
        if worker_field == "request_id":
            return None
        return worker_field


# -- parsing -------------------------------------------------------------------------------------

def _absent(body: dict, name: str) -> bool:
    return body.get(name) is None


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    if _absent(body, name):
        return None
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(name, f"must be an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"between {lo} and {hi}" if lo is not None and hi is not None else f">= {lo}" if lo is not None \
            else f"<= {hi}"
        raise BadRequest(name, f"must be {span}, got {v}")
    return v


def _number(body: dict, name: str, lo: float, hi: float, *, open_low: bool = False) -> float | None:
    if _absent(body, name):
        return None
    v = body[name]
    # an int is exact however large (isfinite would overflow converting it); a float may be inf or nan
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        raise BadRequest(name, f"must be a number, got {v!r}")
    if v > hi or v < lo or (open_low and v == lo):
        raise BadRequest(name, f"must be in {'(' if open_low else '['}{lo}, {hi}], got {v}")
    return float(v)


def _bool(body: dict, name: str) -> bool | None:
    if _absent(body, name):
        return None
    if not isinstance(body[name], bool):
        raise BadRequest(name, f"must be true or false, got {body[name]!r}")
    return body[name]


def lone_surrogate(text: str) -> int | None:
    """Where `text` holds a lone surrogate, which no UTF-8 string (a protobuf's) can carry: JSON's
    `\\ud800` escapes decode to one, and so does a header's byte that is not UTF-8.

    >>> lone_surrogate("fine"), lone_surrogate("a\\ud800b")
    (None, 1)
    """
    try:
        text.encode()
    except UnicodeEncodeError as e:
        return e.start
    return None


def _unicode(param: str, where: str, text: str) -> str:
    at = lone_surrogate(text)
    if at is not None:
        raise BadRequest(param, f"{where}: character {at} is a lone surrogate ({text[at]!r}), not valid Unicode")
    return text


def check_headers(headers) -> None:
    """BadRequest naming the first header (name -> value) longer than MAX_HEADER_BYTES."""
    for name, value in headers.items():
        size = len(value.encode("utf-8", "surrogateescape"))  # as the client sent it
        if size > MAX_HEADER_BYTES:
            raise BadRequest(name.lower(), f"{name.lower()}: a header of {size} bytes; the limit is {MAX_HEADER_BYTES}")


def loads(text: str) -> Any:
    """A request body's JSON, or BadRequest: not JSON, or arrays and objects nested deeper than
    MAX_JSON_DEPTH (past about a thousand levels the parser itself would raise RecursionError).

    >>> loads('{"a": [1]}')
    {'a': [1]}
    >>> loads("[" * 65 + "]" * 65)
    Traceback (most recent call last):
    ...
    specfleet_router.openai_api.BadRequest: the request body nests arrays and objects deeper than 64 levels
    """
    too_deep = BadRequest(None, f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(None, f"the request body is not JSON: {e}") from None
    except RecursionError:
        raise too_deep from None
    # the depth is at most the brackets' count: most bodies (a long token id list too) skip the walk
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _nests_deeper(body, MAX_JSON_DEPTH):
        raise too_deep
    return body


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` deep in `value` (no recursion)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model", "required: the deployment's name (GET /v1/models lists them)")
    return model


def _stop(body: dict) -> list[str]:
    if _absent(body, "stop"):
        return []
    stop = body["stop"]
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list):
        raise BadRequest("stop", f"must be a string or a list of strings, got {stop!r}")
    for i, s in enumerate(stops):
        if not isinstance(s, str) or not s:
            raise BadRequest("stop", f"stop[{i}] must be a non-empty string, got {s!r}")
        _unicode("stop", f"stop[{i}]", s)
    return list(stops)


def _common(body: dict, job: Job) -> Job:
    """The sampling and streaming fields both endpoints share."""
    for name in _UNSUPPORTED_UNLESS_EMPTY:
        if body.get(name) not in (None, {}, [], "", "none"):
            raise BadRequest(name, "not supported by this server")
    for name in _UNSUPPORTED_UNLESS_ZERO:
        if _number(body, name, -2.0, 2.0):
            raise BadRequest(name, "not supported by this server (only 0)")
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise BadRequest("n", f"only 1 choice per request is supported, got {n}")
    best_of = _int(body, "best_of", 1)
    if best_of not in (None, 1):
        raise BadRequest("best_of", f"only 1 is supported, got {best_of}")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise BadRequest("response_format", "only {\"type\": \"text\"} is supported")
    a, b = _int(body, "max_completion_tokens", 1, INT32_MAX), _int(body, "max_tokens", 1, INT32_MAX)
    job.max_tokens, job.max_tokens_param = (a, "max_completion_tokens") if a is not None else (b, "max_tokens")
    temperature = _number(body, "temperature", 0.0, 2.0)
    job.temperature = job.temperature if temperature is None else temperature
    job.top_p = _number(body, "top_p", 0.0, 1.0, open_low=True)
    top_k = _int(body, "top_k", -1, INT32_MAX)  # vLLM's extension: -1 or 0 is off
    job.top_k = None if top_k is None else max(top_k, 0)
    job.seed = _int(body, "seed", INT64_MIN, INT64_MAX)
    job.stop = _stop(body)
    job.ignore_eos = bool(_bool(body, "ignore_eos"))
    job.stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None:
        if not job.stream:
            raise BadRequest("stream_options", "only allowed when stream is true")
        if not isinstance(options, dict):
            raise BadRequest("stream_options", f"must be an object, got {options!r}")
        job.include_usage = bool(_bool(options, "include_usage"))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("user", f"must be a string, got {user!r}")
    job.user = user or None
    return job


def _content(i: int, m: dict) -> str:
    content = m.get("content")
    if isinstance(content, str):
        return content
    if content is None and m.get("role") == "assistant":
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest("messages", f"messages[{i}].content[{j}]: only text parts "
                                 "({\"type\": \"text\", \"text\": ...}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest("messages", f"messages[{i}].content must be a string or a list of text parts, got {content!r}")


def parse_chat(body: Any, default_temperature: float = OPENAI_DEFAULT_TEMPERATURE) -> Job:
    """/v1/chat/completions."""
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    model = _model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest("messages", f"messages[{i}] must be an object with role and content, got {m!r}")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest("messages", f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        # the chat templates know system, not OpenAI's newer name for it
        out.append({"role": "system" if role == "developer" else role,
                    "content": _unicode("messages", f"messages[{i}].content", _content(i, m))})
    job = Job("chat", model, classify_messages(out), messages=out, temperature=default_temperature)
    try:
        _common(body, job)
        job.logprobs = bool(_bool(body, "logprobs"))
        top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top and not job.logprobs:
            raise BadRequest("top_logprobs", "needs logprobs: true")
    except BadRequest as e:
        e.prompt_type = job.prompt_type
        raise
    job.top_logprobs = top or 0
    return job


def parse_completion(body: Any, default_temperature: float = OPENAI_DEFAULT_TEMPERATURE) -> Job:
    """/v1/completions: one prompt (text, or token ids)."""
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    model = _model(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    job = Job("completion", model, PromptType.OTHER, temperature=default_temperature)
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt", "must not be empty")
        job.prompt, job.prompt_type = _unicode("prompt", "prompt", prompt), classify(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t <= INT32_MAX), None)
        if bad is not None:  # the worker knows its vocabulary; a token id is an int32 on the way there
            raise BadRequest("prompt", f"prompt[{bad}]: a token id is between 0 and {INT32_MAX}, got {prompt[bad]}")
        job.prompt_token_ids = prompt  # no text to classify: `other`
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("prompt", f"one prompt per request is supported, got {len(prompt)}")
    else:
        raise BadRequest("prompt", f"must be a string or a list of token ids, got {prompt!r}")
    try:
        _common(body, job)
        if _bool(body, "echo"):
            raise BadRequest("echo", "not supported by this server")
        n = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    except BadRequest as e:
        e.prompt_type = job.prompt_type
        raise
    job.logprobs, job.top_logprobs = n is not None, n or 0
    return job


# -- responses -----------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def chat_logprobs(token_ids, logprobs, top: int) -> dict:
    return {"content": [{"token": token_name(t), "logprob": lp, "bytes": None,
                         "top_logprobs": [{"token": token_name(t), "logprob": lp, "bytes": None}] if top else []}
                        for t, lp in zip(token_ids, logprobs)]}


def completion_logprobs(token_ids, logprobs, top: int) -> dict:
    return {"tokens": [token_name(t) for t in token_ids], "token_logprobs": list(logprobs),
            "top_logprobs": [{token_name(t): lp} for t, lp in zip(token_ids, logprobs)] if top else None,
            "text_offset": None}


def logprobs_of(job: Job, token_ids, logprobs) -> dict | None:
    if not job.logprobs:
        return None
    build = chat_logprobs if job.kind == "chat" else completion_logprobs
    return build(token_ids, logprobs, job.top_logprobs)


def response_id(job: Job, request_id: str) -> str:
    return ("chatcmpl-" if job.kind == "chat" else "cmpl-") + request_id


def full_response(job: Job, rid: str, created: int, resp: pb.GenerateResponse) -> dict:
    """The non-streaming answer to either endpoint."""
    lp = logprobs_of(job, resp.token_ids, resp.logprobs)
    if job.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": resp.text}, "logprobs": lp,
                  "finish_reason": resp.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": resp.text, "logprobs": lp, "finish_reason": resp.finish_reason}
        obj = "text_completion"
    return {"id": response_id(job, rid), "object": obj, "created": created, "model": job.model,
            "system_fingerprint": None, "choices": [choice],
            "usage": usage(resp.usage.prompt_tokens, resp.usage.completion_tokens)}


def chunk(job: Job, rid: str, created: int, *, text: str | None = None, role: bool = False,
          token_ids=(), logprobs=(), finish_reason: str | None = None) -> dict:
    """One streamed chunk with one choice (usage null: include_usage sends its own last chunk)."""
    lp = logprobs_of(job, token_ids, logprobs) if token_ids else None
    if job.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": response_id(job, rid), "object": obj, "created": created, "model": job.model,
           "system_fingerprint": None, "choices": [choice]}
    if job.include_usage:
        out["usage"] = None
    return out


def usage_chunk(job: Job, rid: str, created: int, prompt_tokens: int, completion_tokens: int) -> dict:
    obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    return {"id": response_id(job, rid), "object": obj, "created": created, "model": job.model,
            "system_fingerprint": None, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 502: "server_error", 503: "service_unavailable", 504: "timeout"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object; a 4xx not listed (405, 413) is the client's error all the same.

    >>> error_body(413, "too large")["error"]["type"], error_body(502, "bad gateway")["error"]["type"]
    ('invalid_request_error', 'server_error')
    """
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
