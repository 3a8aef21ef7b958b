"""INT8 products on a CPU through torch's own W8A16 kernel: ATen's `_weight_int8pack_mm`.

A CPU has no fused kernels to read quant.py's span layout in registers: a product there would
dequantize its whole weight at every call, several times what the product itself costs (a vocab
projection most of all). The kernel reads a plain int8 [N, K] weight and one scale a row, which
is INT8 per output channel, symmetric, exactly: the `int8` method's format (config.ON_THE_FLY)
and the vocab projection's under either method (config.VOCAB_QUANTIZATION). So on a CPU those
projections load into this layout, as INT4's load into tinygemm's (model/int4pack.py).

The same integers as the span layout: q - 128, signed. The scales are in the activation dtype
(the kernel's), so in bf16 a row's scale is rounded to bf16 as a bf16 weight would be; in fp32
the products are those of the span layout's dequantized weight.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Int8PackedWeight(NamedTuple):
    """One projection in the kernel's layout: int8 [N, K] and a scale a row, both row-major (a
    draft vocabulary gathers rows of each)."""

    weight: torch.Tensor  # int8 [N, K]: q - 128
    scales: torch.Tensor  # [N], the activation dtype

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in), as a float weight's."""
        return tuple(self.weight.shape)

    @property
    def bits(self) -> int:
        return 8


def applies(bits: int, group_size: int, in_features: int, has_zeros: bool, device) -> bool:
    """Whether a projection of this format loads into this layout on `device`: INT8, one scale a
    row, symmetric, on a CPU."""
    return (device is not None and torch.device(device).type == "cpu" and bits == 8 and not has_zeros
            and group_size in (-1, in_features))


def empty(out_features: int, in_features: int, dtype: torch.dtype) -> Int8PackedWeight:
    return Int8PackedWeight(torch.empty(out_features, in_features, dtype=torch.int8),
                            torch.empty(out_features, dtype=dtype))


def pack(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> Int8PackedWeight:
    """From the stored unsigned integers [N, K] (quant.integers) and fp32 scales [N, 1]."""
    return Int8PackedWeight((q - 128).to(torch.int8), scales.reshape(-1).to(dtype))


def matmul(x: torch.Tensor, w: Int8PackedWeight) -> torch.Tensor:
    """x [..., K] @ dequant(w)^T → [..., N], in the activations' dtype."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.aten._weight_int8pack_mm(flat.to(w.scales.dtype).contiguous(), w.weight, w.scales)
    return out.to(x.dtype).view(*x.shape[:-1], w.weight.shape[0])


def rows(w: Int8PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` dequantized (a tied embedding's lookups): q * s in fp32, cast once."""
    return (w.weight[ids].float() * w.scales[ids].float()[:, None]).to(dtype)


def dequantize(w: Int8PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    return (w.weight.float() * w.scales.float()[:, None]).to(dtype)
