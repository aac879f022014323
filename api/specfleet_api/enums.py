"""What a SpecDecodeDeployment may ask for, named once: draft methods, K policies, precisions,
dtypes, devices and model URI schemes, each split into what the worker serves today and what the API
reserves for later. The CRD's enums, the operator's checks, the worker's config, the CLI and
the engine's proposer registry all read these tuples; tests hold the CRD to them.

Torch-free on purpose: the operator, a router and the CLI import it.
"""

from __future__ import annotations

from enum import Enum


class Method(str, Enum):
    """A draft method: how the draft tokens that the target verifies are proposed."""

    NGRAM = "ngram"  # prompt lookup: no parameters, no model
    DRAFT_MODEL = "draft-model"  # a smaller model that shares the target's tokenizer
    EAGLE = "eagle"  # a draft head on the target's features (specfleet train-draft)
    MEDUSA = "medusa"  # heads on the target's last hidden state (specfleet train-draft --method medusa)
    NONE = "none"  # plain decoding

    def __str__(self) -> str:
        return self.value


class KPolicy(str, Enum):
    """How many draft tokens each step verifies."""

    ADAPTIVE = "adaptive"  # per-request ceiling from its acceptance window, then the cost-aware choice
    FIXED = "fixed"  # always the request's K, clamped to the bounds
    # the adaptive draft, verified where the draft's cumulative probability of the path clears a threshold
    CONFIDENCE = "confidence"
    ENTROPY = "entropy"  # the adaptive draft, verified up to the first position whose draft entropy is high

    def __str__(self) -> str:
        return self.value


class Quantization(str, Enum):
    NONE = "none"
    INT8 = "int8"  # weight-only int8, per-channel scales
    FP8 = "fp8"  # not served yet
    FP4 = "fp4"  # not served yet

    def __str__(self) -> str:
        return self.value


class Dtype(str, Enum):
    AUTO = "auto"  # float32 on the CPU, bfloat16 on CUDA
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"  # not served yet

    def __str__(self) -> str:
        return self.value


class Device(str, Enum):
    """Where the worker computes."""

    AUTO = "auto"  # cuda when torch sees a GPU, else cpu
    CPU = "cpu"
    CUDA = "cuda"

    def __str__(self) -> str:
        return self.value


class UriScheme(str, Enum):
    """Where weights come from. A bare path is a local file or folder (`file`)."""

    FILE = "file"
    GGUF = "gguf"  # a .gguf file, as a path
    HF = "hf"  # a Hugging Face repository: never fetched at run time (not served)
    S3 = "s3"  # not served yet

    def __str__(self) -> str:
        return self.value


METHODS: tuple[str, ...] = tuple(m.value for m in Method)
SERVED_METHODS: tuple[str, ...] = ("ngram", "draft-model", "eagle", "medusa", "none")
SPECULATIVE_METHODS: tuple[str, ...] = tuple(m for m in SERVED_METHODS if m != Method.NONE)

K_POLICIES: tuple[str, ...] = tuple(p.value for p in KPolicy)
SERVED_K_POLICIES: tuple[str, ...] = K_POLICIES

QUANTIZATIONS: tuple[str, ...] = tuple(q.value for q in Quantization)
SERVED_QUANTIZATIONS: tuple[str, ...] = ("none", "int8")

DTYPES: tuple[str, ...] = tuple(d.value for d in Dtype)
SERVED_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16")

DEVICES: tuple[str, ...] = tuple(d.value for d in Device)
SERVED_DEVICES: tuple[str, ...] = DEVICES

URI_SCHEMES: tuple[str, ...] = tuple(s.value for s in UriScheme)
SERVED_URI_SCHEMES: tuple[str, ...] = ("file", "gguf")

#: The engine's short names for a dtype (CLI flags, benchmark configs).
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: What a command line may pass for a dtype: the served names and their short names.
DTYPE_CHOICES: tuple[str, ...] = SERVED_DTYPES + tuple(a for a, d in DTYPE_ALIASES.items() if d in SERVED_DTYPES)

#: speculation.tree: caps on the draft tree the engine builds each step, for every method that
#: drafts. branching: children per node (1: chains only); depth: levels (0: K's bounds alone).
TREE_BRANCHING_MAX, TREE_DEPTH_MAX = 8, 16
#: The branching cap when the spec sets none (the CRD's default, checked by a test).
DEFAULT_TREE_BRANCHING = 1
#: draft.ngram.corpusTokens: tokens of recently finished requests the n-gram drafter also searches
#: (0: only the request's own context); the CRD's bounds and default, checked by a test.
NGRAM_CORPUS_TOKENS_MAX = 262144
DEFAULT_NGRAM_CORPUS_TOKENS = 0


def not_served(kind: str, value: object, served: tuple[object, ...]) -> str:
    """The one wording for a value the API names but the worker does not serve yet.

    >>> not_served("quantization", "fp8", SERVED_QUANTIZATIONS)
    "quantization 'fp8' is not supported yet; supported: none, int8"
    >>> not_served("dtype", "float16", SERVED_DTYPES)
    "dtype 'float16' is not supported yet; supported: auto, float32, bfloat16"
    """
    return f"{kind} {value!r} is not supported yet; supported: {', '.join(map(str, served))}"


def resolve_device(value: str, cuda_available: bool) -> str:
    """The device a worker computes on: `auto` is cuda when there is one (the caller asks torch).
    ValueError names a device the API does not know.

    >>> resolve_device("auto", True), resolve_device("auto", False), resolve_device("cpu", True)
    ('cuda', 'cpu', 'cpu')
    >>> resolve_device("tpu", False)
    Traceback (most recent call last):
    ...
    ValueError: device must be one of auto, cpu, cuda, got 'tpu'
    """
    if value not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {value!r}")
    if value == Device.AUTO:
        return Device.CUDA.value if cuda_available else Device.CPU.value
    return value


def resolve_dtype(value: str, device: str = Device.CPU.value) -> str:
    """The served dtype a worker computes in for an API name or a short name; `auto` is float32
    on the CPU and bfloat16 on CUDA (a resolved device). ValueError says what was wrong.

    >>> resolve_dtype("bf16"), resolve_dtype("auto"), resolve_dtype("auto", "cuda"), resolve_dtype("fp32", "cuda")
    ('bfloat16', 'float32', 'bfloat16', 'float32')
    >>> resolve_dtype("fp16")
    Traceback (most recent call last):
    ...
    ValueError: dtype 'fp16' is not supported yet; supported: auto, float32, bfloat16
    """
    name = DTYPE_ALIASES.get(value, value)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {value!r}")
    if name not in SERVED_DTYPES:
        raise ValueError(not_served("dtype", value, SERVED_DTYPES))
    if name != Dtype.AUTO:
        return name
    return Dtype.BFLOAT16.value if device == Device.CUDA else Dtype.FLOAT32.value


class PromptType(str, Enum):
    """The fixed set of request kinds the router classifies into; the routing table's keys and
    the `prompt_type` label of the acceptance metrics (docs/router.md says how each is told)."""

    CHAT = "chat"  # conversation, open questions, writing, role play
    CODE = "code"  # code fences, programming keywords, "write a function"
    MATH = "math"  # word problems, equations, arithmetic
    EXTRACTION = "extraction"  # pull facts out of a given text: "extract", "identify ... from"
    SUMMARIZATION = "summarization"  # "summarize", "tl;dr"
    TRANSLATION = "translation"  # "translate ... into ..."
    RAG = "rag"  # a long pasted context followed by a question
    OTHER = "other"  # nothing to go on (no words)

    def __str__(self) -> str:
        return self.value


PROMPT_TYPES: tuple[str, ...] = tuple(t.value for t in PromptType)
