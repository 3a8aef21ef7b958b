"""INT4 products through torch's own W4A16 kernel: ATen's `_weight_int4pack_mm` (tinygemm), and its CPU build.

On a CUDA GPU the engine's INT4 products take the span layout's MMA kernel (model/mma_kernels.py),
which reads its tensor cores' operands straight from quant.py's layout: against tinygemm it made
the 4B's decode step as fast at batch 1 and faster at batch 4 to 16, MTP's verify rows
(bench/results/mma-depth). tinygemm stays for the INT4 projections that kernel does not
take (a group size of 32 or 64, N not a multiple of 16), where the GPU's compute capability is
8.0 or more (the H200, Orin, Thor) and the activations bf16. Its weights arrive in registers
already laid out as the tensor cores' m16n8k16 B fragments, two 4-bit values converted per logic
instruction; it is a well-kept library kernel in every CUDA build of torch, NVIDIA's Jetson
wheels included: nothing compiles at start, nothing is tuned.

Two rules, both measured (bench/results/int4-tinygemm-h200):
- up to MAX_ROWS rows (decode, MTP verify) a product takes tinygemm; more (prefill) dequantize
  the packed words in one pass (quant_kernels.dequantize_int4pack) and take cuBLAS;
- projections under MIN_WEIGHTS keep the span layout and the fused Triton kernels.

On a CPU the kernel's CPU build (`_weight_int4pack_mm_for_cpu`, its own packing) takes every INT4
projection of a bf16 engine, whatever its size or row count: the CPU has no fused kernels to
keep, and the alternative is dequantizing the weight at every step. (`dtype=auto` is bf16 there
for INT4 weights, config.EngineArgs._dtype.)

The same integers as every other INT4 format (AWQ, GPTQ, on the fly): tinygemm computes
w = (q - 8) * s + m per group, so the zero point becomes the offset m = (8 - z) * s. Its scales
and offsets are bf16 where ours are fp32, so a group's scale is rounded to bf16 as a bf16 weight
would be. The fused prologues (RMSNorm, residual add, SiLU·up) run as their own kernels before
it (quant_kernels.int4pack_matmul).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

GROUP_SIZES = (32, 64, 128, 256)  # what the kernel takes
# Products of more rows dequantize the weight and take cuBLAS (quant_kernels.dequantize_int4pack):
# the W4A16 kernel's time grows with the rows' tiles of 16, while cuBLAS's is flat here.
MAX_ROWS = 16
# On a GPU, smaller projections keep quant.py's layout and the fused Triton kernels: there a product
# is short enough that the prologue's own launch (RMSNorm or SiLU·up, apart before tinygemm) costs
# more than the faster weight stream saves (Qwen3-0.6B's projections, against Qwen3-4B's). A CPU has
# no such kernels: every projection the kernel takes is its.
MIN_WEIGHTS = 1 << 23
K_TILE = 16  # input columns of one MMA step
INNER_K_TILES = (8, 4, 2)  # K steps a thread holds at once: the first that divides K (more is faster)
ROW_MULTIPLE = {"cuda": 8, "cpu": 16}  # the packing's output rows in one tile


class Int4PackedWeight(NamedTuple):
    """One projection in tinygemm's layout: CUDA's tiles (a 4-d `packed`) or the CPU's (2-d)."""

    packed: torch.Tensor  # CUDA: int32 [N/8, K/(16 inner), 32, inner/2]; CPU: uint8 [N, K/2]
    scales_zeros: torch.Tensor  # bf16 [K/group, N, 2]: (s, (8 - z) * s) per group
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in), as a float weight's."""
        if self.packed.dim() == 2:
            return self.packed.shape[0], self.packed.shape[1] * 2
        return self.packed.shape[0] * 8, self.packed.shape[1] * K_TILE * self.packed.shape[3] * 2


def inner_k_tiles(k: int) -> int | None:
    return next((t for t in INNER_K_TILES if k % (t * K_TILE) == 0), None)


@functools.cache
def _runs_on(device: torch.device) -> bool:
    """Whether this device's torch has the kernel: the CPU build's, or CUDA's on sm80+ (its source
    needs it)."""
    ops = torch.ops.aten
    if device.type == "cpu":
        return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return hasattr(ops, "_weight_int4pack_mm") and hasattr(ops, "_convert_weight_to_int4pack")


def applies(bits: int, group_size: int, out_features: int, in_features: int, dtype: torch.dtype,
            device: torch.device) -> bool:
    """Whether a projection of this format and shape takes tinygemm on `device`."""
    device = torch.device(device)
    return takes(bits, group_size, out_features, in_features, dtype, device.type) and _runs_on(device)


def takes(bits: int, group_size: int, out_features: int, in_features: int, dtype: torch.dtype,
          device_type: str) -> bool:
    """Whether a projection of this format and shape takes tinygemm on a device of this type whose
    torch has the kernel (`applies` checks that too; the memory plan asks it of a board)."""
    if device_type not in ROW_MULTIPLE:
        return False
    if device_type == "cuda":
        from jetserve.engine.model import mma_kernels  # Triton's: imported where a GPU is asked about

        if (out_features * in_features < MIN_WEIGHTS
                or mma_kernels.takes(bits, group_size, out_features, in_features, dtype)):
            return False
    return (bits == 4 and group_size in GROUP_SIZES and out_features % ROW_MULTIPLE[device_type] == 0
            and dtype == torch.bfloat16 and inner_k_tiles(in_features) is not None)


def empty(out_features: int, in_features: int, group_size: int, device_type: str) -> Int4PackedWeight:
    """The buffers a projection loads into, shaped as the kernel's layout on that kind of device
    (allocated on torch's default device: the loader's meta device)."""
    if device_type == "cpu":
        packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
    else:
        inner = inner_k_tiles(in_features)
        packed = torch.empty(out_features // 8, in_features // (K_TILE * inner), 32, inner // 2, dtype=torch.int32)
    return Int4PackedWeight(packed, torch.empty(in_features // group_size, out_features, 2, dtype=torch.bfloat16),
                            group_size)


def pack(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4PackedWeight:
    """tinygemm's layout of unsigned 4-bit integers q (int32 [N, K]) with their groups' zero
    points (int [N, K/group]) and scales (fp32 [N, K/group]), for q's device (the packing runs
    there)."""
    inner = inner_k_tiles(q.shape[1])
    if q.device.type == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), inner)
    else:
        pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)  # [N, K/2]: the even column in the high nibble
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), inner)
    return Int4PackedWeight(packed, scales_zeros(zeros, scales), group_size)


def scales_zeros(zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16 [K/group, N, 2]: each group's scale s and offset (8 - z) * s, computed in fp32."""
    s = scales.float()
    return torch.stack([s, (8 - zeros.float()) * s], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


def matmul(x: torch.Tensor, w: Int4PackedWeight) -> torch.Tensor:
    """x [..., K] (bf16) @ dequantized(w)^T → [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if w.packed.dim() == 2:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, w.packed, w.group_size, w.scales_zeros)
    else:
        out = torch.ops.aten._weight_int4pack_mm(rows, w.packed, w.group_size, w.scales_zeros)
    return out.view(*x.shape[:-1], out.shape[-1])
