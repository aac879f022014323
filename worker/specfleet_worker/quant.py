"""Weight-only int8 quantization with per-output-channel scales (gpt-fast's int8 scheme).

Only weights are quantized; activations stay in the model's dtype and meet the int8 weights
inside one fused matmul (`torch._weight_int8pack_mm` on the CPU, which reads int8 and never
materialises a dequantized copy). Unlike torch's dynamic quantization, activations are not
rounded to int8, which is what keeps greedy outputs close to fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def quantize_per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
    """w: [N, K] float -> (int8 [N, K], scales [N]) with symmetric per-row scaling."""
    w = w.float()
    scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


class Int8WeightOnlyLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scales = quantize_per_channel(linear.weight.data)
        self.register_buffer("weight", q)  # [N, K] int8
        self.register_buffer("scales", scales)  # [N] fp32
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, K] -> [T, N]
        if x.device.type == "cpu":
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales.to(torch.bfloat16)).to(x.dtype)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replaces every nn.Linear (the LM head included) in place; embeddings and norms stay float."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8WeightOnlyLinear(child))
        else:
            quantize_int8(child)
    return model


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
