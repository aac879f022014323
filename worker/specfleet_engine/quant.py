"""Weight-only int8 quantization with per-output-channel scales (gpt-fast's int8 scheme).

Only weights are quantized; activations stay in the model's dtype and meet the int8 weights
inside one fused matmul that reads int8 and never materialises a dequantized copy. Unlike
torch's dynamic quantization, activations are not rounded to int8, which is what keeps greedy
outputs close to fp32.

On the CPU the matmul is our own kernel (csrc/int8_linear.cpp): fp32 activations, fp32
accumulation, every weight byte read once for all the rows of a decoding or verification step
(M = 1..K+1), so verifying a draft costs about what decoding one token does. It is compiled
on first use with -O3 -march=native into a per-CPU cache; where that cannot be done (no
compiler, or SPECFLEET_INT8_KERNEL=torch) the layer falls back, with one warning, to
`torch._weight_int8pack_mm` on bf16 activations.
"""

from __future__ import annotations

import hashlib
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
import torch.nn.functional as F
from torch import Tensor, nn

BLOCK = 32  # output channels per packed block; must match NB in csrc/int8_linear.cpp
KERNEL_ENV = "SPECFLEET_INT8_KERNEL"  # "torch": never build or use the kernel
_SOURCE = Path(__file__).parent / "kernels" / "csrc" / "int8_linear.cpp"


def quantize_per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
    """w: [N, K] float -> (int8 [N, K], scales [N]) with symmetric per-row scaling."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


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


def _build_command(source: Path, out: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    cmd = [_compiler(), "-O3", "-march=native", "-fopenmp", "-std=c++17", "-fPIC", "-shared",
           "-DNDEBUG", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [str(source), "-o", str(out)]
    for p in cpp_extension.library_paths():
        cmd += [f"-L{p}", f"-Wl,-rpath,{p}"]
    return cmd + ["-lc10", "-ltorch_cpu"]


def _cache_dir() -> Path:
    root = os.environ.get("SPECFLEET_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specfleet")
    return Path(root) / "torch_extensions"


def kernel_library_path(cache_dir: Path | None = None) -> Path:
    """Where this source, built for this CPU, torch and these flags, lives in the cache."""
    source = _SOURCE.read_bytes()
    h = hashlib.sha256()
    for part in (source, " ".join(_build_command(Path("src.cpp"), Path("out.so"))).encode(),
                 _cpu_signature().encode(), torch.__version__.encode(), sys.platform.encode()):
        h.update(part)
        h.update(b"\0")
    return (cache_dir or _cache_dir()) / f"specfleet_int8_{h.hexdigest()[:20]}.so"


def _build(so: Path) -> None:
    import fcntl  # POSIX only: elsewhere the ImportError becomes the fallback's warning

    if shutil.which(_compiler()) is None:
        raise RuntimeError(f"no C++ compiler ({_compiler()!r} not found; set CXX)")
    so.parent.mkdir(parents=True, exist_ok=True)
    with open(so.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released if we die, unlike a lock file's existence
        if so.exists():  # another process built it while we waited
            return
        print(f"specfleet: compiling the int8 CPU kernel (once per CPU and torch version, ~15 s) into {so.parent}",
              file=sys.stderr, flush=True)
        tmp = so.with_name(f"{so.stem}.{os.getpid()}.tmp.so")
        try:
            r = subprocess.run(_build_command(_SOURCE, tmp), capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"compiling {_SOURCE.name} failed:\n{(r.stderr or r.stdout)[-3000:]}")
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


def int8_kernel():
    """torch.ops.specfleet_int8 (building it on the first call), or None where it cannot be had."""
    if kernel_disabled():
        _warn_fallback(f"{KERNEL_ENV}=torch")
        return None
    if not _KernelState.tried:
        with _KernelState.lock:
            if not _KernelState.tried:
                try:
                    ops = _load_kernel()
                    overload = ops.linear.default
                    _KernelState.linear = getattr(overload, "_op", overload)  # skips a Python wrapper
                    overload = ops.linear_f32.default
                    _KernelState.linear_f32 = getattr(overload, "_op", overload)
                    _KernelState.ops = ops
                except Exception as e:  # noqa: BLE001 - any failure means: use torch's op
                    _KernelState.error = f"{type(e).__name__}: {e}"
                _KernelState.tried = True
    if _KernelState.ops is None:
        _warn_fallback(_KernelState.error or "not built")
    return _KernelState.ops


# ------------------------------------------------------------------------------------------


class Int8WeightOnlyLinear(nn.Module):
    """y = (x @ Wq^T) * scales (+ bias), Wq int8 [N, K], scales fp32 [N].

    backend: None (the CPU kernel where it can be built, else torch's op), "kernel" (raise if
    it cannot be built) or "torch" (`_weight_int8pack_mm`). SPECFLEET_INT8_KERNEL=torch, read
    when a layer is built, makes None mean "torch". With the kernel the int8 weight is kept
    packed (buffer `weight_packed`, see `pack_int8_weight`) and `weight` is None; otherwise
    `weight` is the plain int8 [N, K]. `int8_weight()` gives [N, K] either way, and
    `use_kernel = False` switches a packed layer to torch's op (unpacking on every call: for
    tests and comparisons)."""

    def __init__(self, linear: nn.Linear, backend: str | None = None):
        super().__init__()
        if backend not in (None, "kernel", "torch"):
            raise ValueError(f"backend must be None, 'kernel' or 'torch', got {backend!r}")
        q, scales = quantize_per_channel(linear.weight.data)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = False
        if q.device.type == "cpu" and backend != "torch":
            packed = int8_kernel() is not None
            if backend == "kernel" and not packed:
                raise RuntimeError(f"int8 CPU kernel unavailable: {_KernelState.error or KERNEL_ENV + '=torch'}")
        self.register_buffer("weight", None if packed else q)  # [N, K] int8
        self.register_buffer("weight_packed", pack_int8_weight(q) if packed else None)
        self.register_buffer("scales", scales)  # [N] fp32
        self.register_parameter(
            "bias", None if linear.bias is None else nn.Parameter(linear.bias.data.clone(), requires_grad=False))
        self._kernel = packed  # a plain attribute: forward reads it on every call
        self._scales_bf16: tuple[tuple, Tensor] | None = None

    @property
    def use_kernel(self) -> bool:
        return self._kernel

    @use_kernel.setter
    def use_kernel(self, on: bool) -> None:
        if on and (self.weight_packed is None or int8_kernel() is None):
            raise RuntimeError("this layer was not built for the int8 kernel")
        self._kernel = bool(on)

    def int8_weight(self) -> Tensor:
        """The int8 weight as [N, K] (a copy when it is kept packed)."""
        if self.weight is not None:
            return self.weight
        return unpack_int8_weight(self.weight_packed, self.out_features)

    def bf16_scales(self) -> Tensor:
        """The scales in bf16 for `_weight_int8pack_mm`, converted once (again only if they change)."""
        s = self.scales
        key = (s.data_ptr(), s._version, s.device, s.dtype)
        if self._scales_bf16 is None or self._scales_bf16[0] != key:
            self._scales_bf16 = (key, s.to(torch.bfloat16))
        return self._scales_bf16[1]

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., K] -> [..., N] in x's dtype. The kernel takes any float dtype and leading dims
        # itself: at a few microseconds a layer, Python-side reshapes and casts would show.
        if self._kernel and x.is_cpu:
            return _KernelState.linear(x, self._buffers["weight_packed"], self._buffers["scales"],
                                       self._parameters["bias"])
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x.is_cpu:
            y = self._forward_torch(x2)
        else:
            y = F.linear(x2, self.int8_weight().to(x.dtype)) * self.scales.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def _forward_torch(self, x: Tensor) -> Tensor:
        w = self.int8_weight()
        if self.in_features % 16 == 0:
            return torch._weight_int8pack_mm(x.to(torch.bfloat16), w, self.bf16_scales()).to(x.dtype)
        # _weight_int8pack_mm reads out of bounds (wrong results, or a crash) when K % 16 != 0
        return (F.linear(x.float(), w.float()) * self.scales.float()).to(x.dtype)


class PackedLinear(nn.Module):
    """An fp32 nn.Linear for the CPU kernel: the weight packed like the int8 one
    (`pack_int8_weight`'s layout, fp32), so that the 2..K+1 rows of a verification step stream
    it once, as one row does. Build it through `pack_linears`, which only does so where the
    kernel loads."""

    def __init__(self, linear_: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear_.in_features, linear_.out_features
        self.register_buffer("weight_packed", pack_int8_weight(linear_.weight.data.float()))
        self.register_buffer("bias", None if linear_.bias is None else linear_.bias.data.float().clone())

    def weight(self) -> Tensor:
        return unpack_int8_weight(self.weight_packed, self.out_features)

    def forward(self, x: Tensor) -> Tensor:
        return _KernelState.linear_f32(x, self._buffers["weight_packed"], self.out_features, self._buffers["bias"])


def pack_linears(model: nn.Module) -> bool:
    """Swaps every fp32 nn.Linear (the LM head included, untied) for PackedLinear; False, and
    nothing changed, where the kernel cannot be had."""
    if int8_kernel() is None:
        return False
    replace_linears(model, PackedLinear)
    return True


def replace_linears(model: nn.Module, make) -> nn.Module:
    """Replaces every nn.Linear below `model`, in place, by make(linear)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, make(child))
        else:
            replace_linears(child, make)
    return model


def quantize_int8(model: nn.Module, backend: str | None = None) -> nn.Module:
    """Replaces every nn.Linear (the LM head included) in place; embeddings and norms stay float."""
    return replace_linears(model, lambda linear: Int8WeightOnlyLinear(linear, backend))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decoding step streams: every parameter and buffer but the embedding
    table (a lookup reads one row) and the RoPE tables."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "tok_embeddings" in name or "rope_" in name or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    tied = getattr(model, "output", None)
    if isinstance(tied, nn.Linear) and tied.weight is getattr(model, "tok_embeddings").weight:
        total += tied.weight.numel() * tied.weight.element_size()  # the tied LM head is streamed
    return total
