"""Wire limits and defaults, in one home (torch-free).

Every bound the API, the router, the worker, the control loop and the CRD share lives here, and
every copy elsewhere imports it (the CRD's schema is YAML: a test checks its numbers against these).
"""

from __future__ import annotations

#: The most draft tokens one speculative step may propose (speculation.kMax's upper bound).
K_LIMIT = 32

#: Draft nodes one sequence verifies in a step, at most (a chain's K, or a tree's nodes): what a
#: request's KV reservation leaves room for beyond its context.
MAX_DRAFT_NODES = K_LIMIT

#: The longest request id (gRPC `request_id`, the router's `x-request-id`): the worker refuses a
#: longer one (INVALID_ARGUMENT); the router replaces a longer incoming header with one of its own,
#: and its mirrors' ids (the id plus a suffix) are cut to fit.
MAX_REQUEST_ID = 128

#: The range of the wire's integers. max_tokens, top_k and prompt_token_ids are protobuf int32s and
#: seed an int64: the router's HTTP front refuses a value outside (400 naming the field) rather
#: than fail to build the message.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

#: The longest request header value the router's HTTP front takes (x-session-id, ...): aiohttp's
#: own default, kept, so that what was served before still is; a longer one gets a 400 naming the
#: header (OpenAI's JSON error, not the HTTP parser's plain text).
MAX_HEADER_BYTES = 8190

#: How deep arrays and objects may nest in an HTTP request body (OpenAI's requests nest 4 deep);
#: deeper is a 400, not a parser's RecursionError.
MAX_JSON_DEPTH = 64

# Temperature when a request names none. The two fronts differ on purpose (docs/router.md,
# docs/worker-contract.md):
#: - an OpenAI-style request (the router's HTTP front, `--default-temperature`) samples at
#:   OpenAI's default, 1.0: what OpenAI clients expect of a field they leave out;
OPENAI_DEFAULT_TEMPERATURE = 1.0
#: - a specfleet.v1 request (gRPC: a worker, or the router's gRPC front, which forwards the message
#:   as it is) whose optional `temperature` is unset is greedy, as the proto has said since v1. The
#:   router's HTTP front always sets the field, so only direct gRPC callers meet this default;
#:   changing it would silently turn every such caller's greedy outputs into samples.
WIRE_DEFAULT_TEMPERATURE = 0.0

#: A specfleet.v1 request's max_tokens when unset (under the worker's own limit), whichever engine
#: serves it: the router asks a vLLM pool for the same.
WIRE_DEFAULT_MAX_TOKENS = 128

#: A temperature under this is greedy decoding (argmax; no generator drawn, logprobs at T=1): a
#: distribution at T < 1e-5 is one-hot up to ties anyway, and dividing float32 logits by a T under
#: about 1e-38 gives NaN probabilities (measured: 1e-40 does, 1e-30 does not).
GREEDY_BELOW = 1e-5


def is_greedy(temperature: float | None) -> bool:
    """Whether a request decodes greedily: its temperature (None: unset on the wire) under
    `GREEDY_BELOW`. The one definition the engine, the worker and the router's drift check share.

    >>> is_greedy(0.0), is_greedy(None), is_greedy(1e-7), is_greedy(0.01), is_greedy(1.0)
    (True, True, True, False, False)
    """
    return (WIRE_DEFAULT_TEMPERATURE if temperature is None else temperature) < GREEDY_BELOW
