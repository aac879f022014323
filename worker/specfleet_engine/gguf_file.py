"""A GGUF file's header, read in one pass, and its tensors, mapped and dequantized on demand.

`gguf.GGUFReader` builds a numpy view of every part of every metadata field before it returns: on
SmolLM2 (49k tokens, 48k merges) that is half a million small arrays, seconds on a fast core and
8-12 s on a slow one, paid by every worker start. This reader walks the same header with
`struct` and skips the tokenizer's arrays (their entries are counted, not read): the values a
model needs come back as Python scalars and small lists, the tensors as (name, shape, type, offset)
over one read-only memory map. Little-endian files only (what llama.cpp writes)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# arrays whose entries a model's loader never reads: counted and skipped
SKIPPED = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                     "tokenizer.ggml.scores"})

# GGUF value types with a fixed size: their struct format (8 is a string, 9 an array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    ggml_type: int
    offset: int  # from the start of the file


class GGUFFile:
    """metadata: key -> value (tokenizer arrays skipped, see `lengths`); tensors: in file order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata: dict[str, object] = {}
        self.lengths: dict[str, int] = {}  # a skipped array's number of entries
        self.tensors: list[TensorInfo] = []
        self._map: np.memmap | None = None
        with open(self.path, "rb") as f:
            self._parse(f)

    def _parse(self, f) -> None:
        buf = memoryview(f.read(1 << 20))
        pos = 0

        def need(n: int) -> None:
            nonlocal buf, pos
            if pos + n > len(buf):  # the header goes on past what was read: read as much again
                more = f.read(max(n, len(buf)))
                if pos + n > len(buf) + len(more):
                    raise ValueError(f"{self.path}: truncated GGUF header")
                buf = memoryview(bytes(buf[pos:]) + more)
                pos = 0

        def take(fmt: str):
            nonlocal pos
            size = struct.calcsize("<" + fmt)
            need(size)
            out = struct.unpack_from("<" + fmt, buf, pos)
            pos += size
            return out[0] if len(out) == 1 else out

        def string() -> str:
            nonlocal pos
            n = take("Q")
            need(n)
            s = bytes(buf[pos:pos + n]).decode("utf-8", errors="replace")
            pos += n
            return s

        def skip_strings(count: int) -> None:
            nonlocal pos
            for _ in range(count):
                need(8)
                n = struct.unpack_from("<Q", buf, pos)[0]
                need(8 + n)
                pos += 8 + n

        def value(vtype: int, key: str):
            nonlocal pos
            if vtype in _SCALARS:
                return take(_SCALARS[vtype])
            if vtype == _STRING:
                return string()
            if vtype != _ARRAY:
                raise ValueError(f"{self.path}: metadata {key!r} has unknown GGUF type {vtype}")
            etype, count = take("I"), take("Q")
            if key in SKIPPED:
                self.lengths[key] = count
                if etype == _STRING:
                    skip_strings(count)
                elif etype in _SCALARS:
                    size = struct.calcsize("<" + _SCALARS[etype]) * count
                    need(size)
                    pos += size
                else:
                    raise ValueError(f"{self.path}: metadata {key!r} is an array of GGUF type {etype}")
                return None
            return [value(etype, key) for _ in range(count)]

        need(24)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (its first bytes are {bytes(buf[:4])!r})")
        pos = 4
        version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} (this reader reads 2 and 3)")
        for _ in range(n_kv):
            key = string()
            v = value(take("I"), key)
            if key not in SKIPPED:
                self.metadata[key] = v
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = tuple(take("Q") for _ in range(take("I")))
            infos.append((name, dims, take("I"), take("Q")))
        consumed = f.tell() - (len(buf) - pos)
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"{self.path}: general.alignment {align} is not a power of two")
        data_offset = -(-consumed // align) * align
        self.tensors = [TensorInfo(n, d, t, data_offset + o) for n, d, t, o in infos]

    def tensor_data(self, t: TensorInfo) -> np.ndarray:
        """The tensor's raw data, as `gguf.GGUFReader` presents it: a read-only map of the file,
        shaped with the slowest dimension first (quantized types: bytes per row last)."""
        import gguf

        qtype = gguf.GGMLQuantizationType(t.ggml_type)
        shape = tuple(reversed(t.shape))
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(t.shape, dtype=np.int64)) // block * type_size
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        if t.offset + nbytes > len(self._map):
            raise ValueError(f"{self.path}: tensor {t.name} ends past the end of the file")
        raw = self._map[t.offset:t.offset + nbytes]
        plain = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}
        if qtype in plain:
            return raw.view(plain[qtype]).reshape(shape)
        return raw.reshape(gguf.quant_shape_to_byte_shape(shape, qtype))

    def dequantized(self, t: TensorInfo) -> np.ndarray:
        """The tensor in fp32, slowest dimension first, in memory of its own."""
        import gguf

        out = np.asarray(gguf.quants.dequantize(self.tensor_data(t), gguf.GGMLQuantizationType(t.ggml_type)),
                         dtype=np.float32)
        if not out.flags.writeable:  # an F32 tensor comes back as the file's read-only map: copied
            out = out.copy()
        return out.reshape(tuple(reversed(t.shape)))
