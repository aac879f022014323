"""Weight-only int8 quantization with per-output-channel scales (gpt-fast's int8 scheme).

Only weights are quantized; activations stay in the model's dtype and meet the int8 weights
inside one fused matmul that reads int8 and never materialises a dequantized copy. Unlike
torch's dynamic quantization, activations are not rounded to int8, which is what keeps greedy
outputs close to fp32.

On the CPU the matmul is our own kernel (kernels/cpu_gemm.py): every weight byte read once for
all the rows of a step, through the best path the CPU runs (AVX-512, AVX2 + FMA, or portable C++;
SPECFLEET_CPU_ISA caps it). AVX-512 and portable multiply fp32 activations in fp32; AVX2 rounds
them to int16 per block of 64 features and sums integer products exactly (int8_linear.cpp: the
int8 -> fp32 conversions cost more than the weights' streaming on CPUs that split 256-bit
operations). Where it cannot be built
(no compiler, or SPECFLEET_INT8_KERNEL=torch) the layer falls back, with one warning, to
`torch._weight_int8pack_mm` on bf16 activations. On CUDA (a layer quantized there) the weight is
dequantized to the activations' dtype for each F.linear: simple and correct, not fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .kernels.cpu_gemm import (BLOCK, KERNEL_ENV, _KernelState, active_isa, int8_kernel, kernel_disabled,  # noqa: F401
                               kernel_library_path, pack_int8_weight, unpack_int8_weight)


def quantize_per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
    """w: [N, K] float -> (int8 [N, K], scales [N]) with symmetric per-row scaling."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


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

    def linear(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """forward(x) (+ residual), called by the model without nn.Module's call machinery."""
        if self._kernel and x.is_cpu:
            y = _KernelState.linear(x, self._buffers["weight_packed"], self._buffers["scales"],
                                    self._parameters["bias"])
        else:
            y = self._forward_any(x)
        return y if residual is None else residual + y

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., K] -> [..., N] in x's dtype. The kernel takes any float dtype and leading dims
        # itself: at a few microseconds a layer, Python-side reshapes and casts would show.
        if self._kernel and x.is_cpu:
            return _KernelState.linear(x, self._buffers["weight_packed"], self._buffers["scales"],
                                       self._parameters["bias"])
        return self._forward_any(x)

    def _forward_any(self, x: Tensor) -> Tensor:
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

    def linear(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """forward(x) (+ residual), called by the model without nn.Module's call machinery."""
        y = _KernelState.linear_f32(x, self._buffers["weight_packed"], self.out_features, self._buffers["bias"])
        return y if residual is None else residual + y

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


def pack_linears(model: nn.Module, force: bool = False) -> bool:
    """Swaps every fp32 nn.Linear (the LM head included, untied) for PackedLinear; False, and
    nothing changed, where the kernel cannot be had, the model is not on the CPU, or (unless
    `force`) the kernel's path is the portable one: its plain loops lose to torch's fp32 GEMM
    (2-5x at one row, 2x at a prefill's), while its SIMD paths beat it; int8 weights keep the
    portable path, which still beats torch's int8 op."""
    if any(not p.is_cpu for p in model.parameters()) or int8_kernel() is None:
        return False
    if not force and active_isa() == "portable":
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


def dense_weight(layer: nn.Module) -> Tensor:
    """Any of our linear layers' weight as a plain fp32 [out, in] (a copy where it is stored
    otherwise): nn.Linear, TransposedLinear, PackedLinear, Int8WeightOnlyLinear (de-quantized)."""
    from .model import TransposedLinear
    if isinstance(layer, nn.Linear):
        return layer.weight.detach().float()
    if isinstance(layer, TransposedLinear):
        return layer.weight_t.t().float()
    if isinstance(layer, PackedLinear):
        return layer.weight().float()
    if isinstance(layer, Int8WeightOnlyLinear):
        return layer.int8_weight().float() * layer.scales.float()[:, None]
    raise TypeError(f"not a linear layer: {type(layer).__name__}")
