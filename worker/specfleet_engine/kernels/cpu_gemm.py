"""Our CPU kernel library (csrc/): how it is built, cached and loaded, which of its paths runs,
and the weight layout it reads.

It holds the few-row GEMM (csrc/int8_linear.cpp) as two ops, `linear` (int8 weights, per-channel
scales) and `linear_f32` (fp32 weights), and `decoder_step` (csrc/decoder_step.cpp), a few-row
step's whole stack of decoder layers in one call over that GEMM (model.py's `FusedStack`).
The GEMM: fp32 accumulation, every weight byte read once for all the rows of a decoding or
verification step (M = 1..K+1), so verifying a draft costs about what decoding one token does.
It is compiled on first use with -O3 -march=native into a per-CPU cache; where that cannot be
done (no compiler, or SPECFLEET_INT8_KERNEL=torch) `int8_kernel()` returns None, warns once, and
the layers in quant.py fall back to torch's ops (their reference path, same signature).

The library holds three paths ("ISAs"), each compiled for its instruction set whatever -march
says: "avx512" (AVX-512F), "avx2" (AVX2 + FMA) and "portable" (plain C++ the compiler
vectorizes). When it loads, the ops run the best one the CPU has (`available_isas()`, best
first), at most SPECFLEET_CPU_ISA=avx512|avx2|portable where that is set (a cap: an unknown value
is an error, raised by `int8_kernel()`); `active_isa()` names it. `linear_isa` / `linear_f32_isa`
run a named path, for tests and benchmarks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

BLOCK = 32  # output channels per packed block; must match NB in csrc/int8_linear.cpp
KERNEL_ENV = "SPECFLEET_INT8_KERNEL"  # "torch": never build or use the kernel
ISA_ENV = "SPECFLEET_CPU_ISA"  # the best path the ops may run: a cap on what the CPU has
ISAS = ("avx512", "avx2", "portable")  # the kernel's paths, best first (kIsaNames in the C++)
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = (_CSRC / "int8_linear.cpp", _CSRC / "decoder_step.cpp")  # one library
_HEADERS = (_CSRC / "cpu_gemm.h",)


def pack_int8_weight(q: Tensor) -> Tensor:
    """int8 [N, K] -> the kernel's layout, int8 [ceil(N / 32), K, 32]: block b holds output
    channels 32b..32b+31, their 32 weights for one k side by side (zeros past N)."""
    n, k = q.shape
    n_pad = -(-n // BLOCK) * BLOCK
    if n_pad != n:
        q = torch.cat([q, q.new_zeros(n_pad - n, k)])
    return q.reshape(n_pad // BLOCK, BLOCK, k).transpose(1, 2).contiguous()


def unpack_int8_weight(packed: Tensor, n: int) -> Tensor:
    """The inverse of `pack_int8_weight`: int8 [N, K]."""
    blocks, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * BLOCK, k)[:n]


# ------------------------------------------------------------------------------------------
# Building and loading the kernel


class _KernelState:
    lock = threading.Lock()
    tried = False
    ops = None  # torch.ops.specfleet_int8 once loaded
    linear = None  # its linear op, the cheapest callable form of it
    linear_f32 = None  # the same for fp32 weights
    decoder_step = None  # the fused stack of decoder layers (csrc/decoder_step.cpp)
    isa: str | None = None  # the path linear and linear_f32 run
    error: str | None = None
    warned = False


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU model and its feature flags."""
    try:
        model, flags = "", ""
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu model", "Processor") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
                if model and flags:
                    break
        if flags:
            return f"{platform.machine()}|{model}|{flags}"
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{platform.platform()}"


def _compiler() -> str:
    return os.environ.get("CXX") or "c++"


def _build_command(sources: tuple[Path, ...], out: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    cmd = [_compiler(), "-O3", "-march=native", "-fopenmp", "-std=c++17", "-fPIC", "-shared",
           "-DNDEBUG", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [str(s) for s in sources] + ["-o", str(out)]
    for p in cpp_extension.library_paths():
        cmd += [f"-L{p}", f"-Wl,-rpath,{p}"]
    return cmd + ["-lc10", "-ltorch_cpu"]


def cache_root() -> Path:
    """specfleet's cache folder: $SPECFLEET_CACHE, else $XDG_CACHE_HOME/specfleet, else
    ~/.cache/specfleet (what is built once per machine lives under it)."""
    root = os.environ.get("SPECFLEET_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specfleet")
    return Path(root)


def _cache_dir() -> Path:
    return cache_root() / "torch_extensions"


def kernel_library_path(cache_dir: Path | None = None) -> Path:
    """Where this source, built for this CPU, torch and these flags, lives in the cache."""
    source = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    command = _build_command(tuple(Path(p.name) for p in _SOURCES), Path("out.so"))
    h = hashlib.sha256()
    for part in (source, " ".join(command).encode(),
                 _cpu_signature().encode(), torch.__version__.encode(), sys.platform.encode()):
        h.update(part)
        h.update(b"\0")
    return (cache_dir or _cache_dir()) / f"specfleet_int8_{h.hexdigest()[:20]}.so"


def _announce(msg: str) -> None:
    """A wait worth saying, where the process says things: through the `specfleet` loggers when it
    set them up (the worker's JSON lines: a plain line would break them), else on stderr (the CLI)."""
    if logging.getLogger("specfleet").handlers:
        logging.getLogger("specfleet.kernels").info(msg)
    else:
        print(msg, file=sys.stderr, flush=True)


def _build(so: Path) -> None:
    import fcntl  # POSIX only: elsewhere the ImportError becomes the fallback's warning

    if shutil.which(_compiler()) is None:
        raise RuntimeError(f"no C++ compiler ({_compiler()!r} not found; set CXX)")
    so.parent.mkdir(parents=True, exist_ok=True)
    with open(so.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released if we die, unlike a lock file's existence
        if so.exists():  # another process built it while we waited
            return
        _announce(f"specfleet: compiling the CPU kernels (once per CPU and torch version, ~30 s) into {so.parent}")
        tmp = so.with_name(f"{so.stem}.{os.getpid()}.tmp.so")
        try:
            r = subprocess.run(_build_command(_SOURCES, tmp), capture_output=True, text=True)
            if r.returncode != 0:
                names = " and ".join(p.name for p in _SOURCES)
                raise RuntimeError(f"compiling {names} failed:\n{(r.stderr or r.stdout)[-3000:]}")
            os.replace(tmp, so)  # atomic: a reader sees no library or a whole one
        finally:
            tmp.unlink(missing_ok=True)


def _load_kernel():
    so = kernel_library_path()
    if not so.exists():
        try:
            _build(so)
        except OSError:  # a read-only or missing home: build under the temp dir instead
            so = kernel_library_path(Path(tempfile.gettempdir()) / f"specfleet-{os.getuid()}" / "torch_extensions")
            if not so.exists():
                _build(so)
    torch.ops.load_library(str(so))
    return torch.ops.specfleet_int8


def _warn_fallback(reason: str) -> None:
    if not _KernelState.warned:
        _KernelState.warned = True
        warnings.warn(f"int8 CPU kernel unavailable ({reason}); falling back to torch's ops "
                      "(int8: torch._weight_int8pack_mm, fp32: MKL's GEMM)",
                      RuntimeWarning, stacklevel=3)


def kernel_disabled() -> bool:
    return os.environ.get(KERNEL_ENV, "").strip().lower() == "torch"


def isa_cap() -> str:
    """The best path SPECFLEET_CPU_ISA allows ("avx512", i.e. no cap, where it is unset)."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return ISAS[0]
    if value not in ISAS:
        raise ValueError(f"{ISA_ENV}={os.environ[ISA_ENV]!r} is not a CPU kernel path: expected one of "
                         f"{', '.join(ISAS)} (the best path to run, at most), or unset for the best the CPU has")
    return value


def int8_kernel():
    """torch.ops.specfleet_int8 (building it on the first call), or None where it cannot be had.

    Loading it picks the path its ops run (`select_isa`); a bad SPECFLEET_CPU_ISA raises
    ValueError here rather than falling back: it is a configuration error to fix."""
    if kernel_disabled():
        _warn_fallback(f"{KERNEL_ENV}=torch")
        return None
    if not _KernelState.tried:
        with _KernelState.lock:
            if not _KernelState.tried:
                cap = isa_cap()
                try:
                    ops = _load_kernel()
                    overload = ops.linear.default
                    _KernelState.linear = getattr(overload, "_op", overload)  # skips a Python wrapper
                    overload = ops.linear_f32.default
                    _KernelState.linear_f32 = getattr(overload, "_op", overload)
                    overload = ops.decoder_step.default
                    _KernelState.decoder_step = getattr(overload, "_op", overload)
                    _KernelState.isa = ops.set_isa(cap)
                    _KernelState.ops = ops
                except Exception as e:  # noqa: BLE001 - any failure means: use torch's op
                    _KernelState.error = f"{type(e).__name__}: {e}"
                _KernelState.tried = True
    if _KernelState.ops is None:
        _warn_fallback(_KernelState.error or "not built")
    return _KernelState.ops


def select_isa(cap: str | None = None) -> str | None:
    """Makes the ops run the best path the CPU has, at most `cap` (default: SPECFLEET_CPU_ISA,
    read again); returns that path, or None where the kernel cannot be had."""
    cap = isa_cap() if cap is None else cap
    if cap not in ISAS:
        raise ValueError(f"unknown CPU kernel path {cap!r}: expected one of {', '.join(ISAS)}")
    ops = int8_kernel()
    if ops is None:
        return None
    _KernelState.isa = ops.set_isa(cap)
    return _KernelState.isa


def available_isas() -> list[str]:
    """The paths this CPU can run, best first (the kernel's own answer; loads it). [] where the
    kernel cannot be had."""
    ops = int8_kernel()
    return list(ops.cpu_isas()) if ops is not None else []


def active_isa() -> str | None:
    """The path `linear` and `linear_f32` run (loads the kernel); None where it cannot be had."""
    return _KernelState.isa if int8_kernel() is not None else None


def kernel_summary() -> str:
    """What runs the CPU's linear layers, for logs and benchmark results, loading nothing: the
    kernel's active path ("avx2"), "torch (why)" where it fell back, or "not loaded"."""
    if _KernelState.ops is not None:
        return _KernelState.isa or "unknown"
    if kernel_disabled():
        return f"torch ({KERNEL_ENV}=torch)"
    if _KernelState.error:
        return f"torch (the kernel did not build: {_KernelState.error.splitlines()[0][:200]})"
    return "not loaded"
