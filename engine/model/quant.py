"""Weight-only quantized projections: the published layouts, unpacked once into one of ours.

Every format loads into the same runtime layout, so one kernel family serves all of them:
`qweight` int32 [N, K * bits / 32], the unsigned integers of each output row packed along the
input dim in spans of 16 words (`SPAN_WORDS`): field i (bits i*b..) of word j of span c holds
input column c * 16 * fields + i * 16 + j (fields = 32 / bits). A kernel's threads read a row's
words side by side, and field i of 16 consecutive words is 16 consecutive input columns, so
masking one field of a tile of words gives a tile of weights whose activations are a contiguous
run: no per-weight word gathers, no reshapes. `scales` fp32 [N, K/group]; `zeros` uint8 [N, K/group] for
formats with zero points, None for symmetric ones (zero 2**(bits-1): a signed integer is stored
offset by it). w = (q - z) * s in fp32, where it is exact (a small integer times an fp16 scale),
so rounding it to fp16 gives each format's reference dequantization bit for bit; the product is
cast to the activation dtype.

- AWQ (GEMM version): qweight int32 [K, N/8] packed along the output dim in the order
  0 2 4 6 1 3 5 7, qzeros likewise [K/group, N/8], scales [K/group, N].
- GPTQ: qweight int32 [K/(32/bits), N] packed along the input dim in natural order, qzeros
  [K/group, N/(32/bits)] (the v1 format stores zero - 1), scales [K/group, N], g_idx [K].
- On the fly from a float checkpoint: INT8 symmetric per output channel (vLLM's `int8`), INT4
  asymmetric per group of 128, round to nearest (AWQ's min-max formula without its search); under
  either, the vocab projection INT8 (config.VOCAB_QUANTIZATION) and a tied embedding read from it
  (`QuantEmbedding`).

Decode steps (a few rows on CUDA) run the fused W8A16/W4A16 kernels of quant_kernels.py, which
dequantize in registers; other shapes (prefill, the CPU) dequantize into the activation dtype
and run the float product. The exceptions are INT4 projections with bf16 activations, large ones
on an sm80+ GPU and all of them on a CPU: they load into tinygemm's layout instead and take
torch's W4A16 kernel (model/int4pack.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from jetserve.engine.config import QuantizationConfig
from jetserve.engine.model import int4pack, int8pack
from jetserve.engine.model.checkpoint import Checkpoint, CheckpointError
from jetserve.engine.model.qwen3 import KernelUser

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ puts output column 8j + AWQ_ORDER[i] in nibble i of word j
_AWQ_UNORDER = tuple(AWQ_ORDER.index(c) for c in range(8))


SPAN_WORDS = 16  # words a span: field i of a span's words is 16 consecutive input columns


class QuantizedWeight(NamedTuple):
    """What the kernels read: the runtime layout of one projection (see the module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int  # input columns per scale (K: per output channel)

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in), as a float weight's."""
        return self.qweight.shape[0], self.qweight.shape[1] * 32 // self.bits


# Weights a product off the fused kernels dequantizes at once: a bigger projection (a vocab
# projection, hundreds of MB in the model dtype) is multiplied a block of output rows at a time,
# so no step's temporary grows past what the largest decoder projection of a model this size needs.
MAX_DEQUANTIZED = 64 * 2**20
ROWS_ALIGN = 16  # float_product's blocks are whole 16-row tiles


def quant_rows(w: QuantizedWeight, rows: torch.Tensor | slice) -> QuantizedWeight:
    """The weight of these output rows alone (an index tensor, or a slice: views)."""
    pick = (lambda t: t[rows]) if isinstance(rows, slice) else (lambda t: t.index_select(0, rows))
    return w._replace(qweight=pick(w.qweight), scales=pick(w.scales),
                      zeros=None if w.zeros is None else pick(w.zeros))


def float_product(x: torch.Tensor, w: QuantizedWeight, dequant=None) -> torch.Tensor:
    """x @ dequant(w)^T through the float product, at most MAX_DEQUANTIZED weights dequantized at
    a time; `dequant(w, dtype)`: how (quant_kernels.dequantized on a GPU), else `dequantize`."""
    dequant = dequant or dequantize
    n, k = w.shape
    block = max(ROWS_ALIGN, MAX_DEQUANTIZED // k // ROWS_ALIGN * ROWS_ALIGN)
    if n <= block:
        return F.linear(x, dequant(w, x.dtype))
    out = x.new_empty(*x.shape[:-1], n)
    for lo in range(0, n, block):
        out[..., lo:lo + block] = F.linear(x, dequant(quant_rows(w, slice(lo, lo + block)), x.dtype))
    return out


def span(bits: int) -> int:
    """Input columns a span of words holds: the input dim must be a multiple."""
    return SPAN_WORDS * 32 // bits


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned integers [N, K] → int32 words [N, K * bits / 32] in the span layout."""
    n, k = q.shape
    if k % span(bits):
        raise ValueError(f"{bits}-bit weights need an input dim that is a multiple of {span(bits)}, not {k}")
    fields = q.to(torch.int32).view(n, k // span(bits), 32 // bits, SPAN_WORDS).transpose(-1, -2)
    out = fields[..., 0]
    for i in range(1, 32 // bits):
        out = out | (fields[..., i] << (i * bits))  # int32 shifts wrap into the sign bit, as packed words do
    return out.reshape(n, -1).contiguous()


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words → their `bits`-bit fields, low bits first, on a new last dim (int32)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    return (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def integers(w: QuantizedWeight) -> torch.Tensor:
    """The stored (unsigned) integers as int32 [N, K]."""
    n = w.qweight.shape[0]
    fields = unpack(w.qweight, w.bits).view(n, -1, SPAN_WORDS, 32 // w.bits)
    return fields.transpose(-1, -2).reshape(n, -1)


def zero_points(w: QuantizedWeight) -> torch.Tensor:
    """int32 [N, K/group]: the stored ones, or the midpoint a symmetric format is offset by."""
    if w.zeros is not None:
        return w.zeros.to(torch.int32)
    return torch.full(w.scales.shape, 1 << (w.bits - 1), dtype=torch.int32, device=w.scales.device)


def dequantize(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """(q - z) * s in fp32 (exact), cast to `dtype` (rounded once)."""
    q = integers(w) - zero_points(w).repeat_interleave(w.group_size, dim=1)
    return (q.float() * w.scales.float().repeat_interleave(w.group_size, dim=1)).to(dtype)


def quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool) -> QuantizedWeight:
    """Round to nearest, in fp32: symmetric (no zero points) or min-max with zero points;
    group_size -1: one scale per output channel."""
    n, k = weight.shape
    group = k if group_size == -1 else group_size
    if k % group:
        raise ValueError(f"group size {group} does not divide the input dim {k}")
    w = weight.float().reshape(n, k // group, group)
    if sym:
        top = 2 ** (bits - 1) - 1
        scales = w.abs().amax(-1, keepdim=True).clamp(min=1e-8) / top
        q = torch.round(w / scales).clamp(-top, top)
        zeros = None
    else:
        top = 2**bits - 1
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scales = (hi - lo).clamp(min=1e-5) / top
        z = (-torch.round(lo / scales)).clamp(0, top)
        q = (torch.round(w / scales) + z).clamp(0, top)
        zeros = z.reshape(n, -1).to(torch.uint8)
    q = q.reshape(n, k) + (2 ** (bits - 1) if sym else 0)  # stored unsigned: symmetric values around the midpoint
    return QuantizedWeight(pack(q, bits), scales.reshape(n, -1).contiguous(), zeros, bits, group)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> QuantizedWeight:
    """AWQ GEMM tensors → ours (see the module docstring)."""
    q = unpack(qweight, 4)[..., list(_AWQ_UNORDER)].flatten(1)  # [K, N]
    z = unpack(qzeros, 4)[..., list(_AWQ_UNORDER)].flatten(1)  # [K/group, N]
    return QuantizedWeight(pack(q.t(), 4), scales.t().float().contiguous(), z.t().to(torch.uint8).contiguous(), 4,
                           group_size)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
              zero_offset: int) -> QuantizedWeight:
    """GPTQ tensors → ours; `zero_offset` 1 for the v1 format, which stores zero points minus one."""
    q = unpack(qweight, bits)  # [K/pack, N, pack]
    q = q.permute(0, 2, 1).flatten(0, 1)  # [K, N]
    z = (unpack(qzeros, bits).flatten(1) + zero_offset) & ((1 << bits) - 1)  # [K/group, N]
    return QuantizedWeight(pack(q.t(), bits), scales.t().float().contiguous(), z.t().to(torch.uint8).contiguous(),
                           bits, group_size)


def read_quantized(ckpt: Checkpoint, prefixes: list[str], config: QuantizationConfig) -> QuantizedWeight:
    """The projections `prefixes` (e.g. q_proj, k_proj, v_proj of a layer) of an AWQ or GPTQ
    checkpoint, in our layout, concatenated along the output dim like our fused parameters."""
    parts = []
    for prefix in prefixes:
        tensors = {t: ckpt.get(f"{prefix}.{t}") for t in ("qweight", "qzeros", "scales")}
        if config.method == "awq":
            part = from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], config.group_size)
        else:
            part = from_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], config.bits,
                             config.group_size, config.zero_offset)
            if f"{prefix}.g_idx" in ckpt:
                _check_g_idx(ckpt, prefix, part)
        n, k = part.shape
        if part.scales.shape != (n, k // config.group_size):
            raise CheckpointError(f"{ckpt.dir}: {prefix}.scales has shape {list(tensors['scales'].shape)}, expected "
                                  f"{[k // config.group_size, n]} for group size {config.group_size}")
        parts.append(part)
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
    return QuantizedWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), zeros,
                           first.bits, first.group_size)


def _check_g_idx(ckpt: Checkpoint, prefix: str, part: QuantizedWeight) -> None:
    """Without act-order, column k is in group k // group_size; anything else is refused."""
    g_idx = ckpt.get(f"{prefix}.g_idx")
    k = part.shape[1]
    if not torch.equal(g_idx.to(torch.int64), torch.arange(k) // part.group_size):
        raise CheckpointError(f"{ckpt.dir}: {prefix}.g_idx reorders the input columns (act-order); "
                              "not supported yet: re-export with desc_act=false")


class QuantLinear(KernelUser):
    """A bias-free projection with quantized weights. In quant.py's layout a few rows on CUDA
    take the fused kernel (through the model's kernels, like `Linear`) and anything else
    dequantizes and multiplies; in tinygemm's (`tinygemm`: the device type whose layout,
    model/int4pack.py) every product takes torch's W4A16 kernel (on CUDA up to int4pack.MAX_ROWS
    rows, the prologues apart first; more dequantize); in torch's INT8 CPU layout (`int8mm`,
    model/int8pack.py) every product takes its W8A16 kernel."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, has_zeros: bool,
                 tinygemm: str | None = None, int8pack_dtype: torch.dtype | None = None):
        super().__init__()
        if in_features % span(bits):
            raise CheckpointError(f"{bits}-bit weights need input dims in multiples of {span(bits)}: "
                                  f"a projection has {in_features}")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.group_size = in_features if group_size == -1 else group_size
        if in_features % self.group_size:
            raise CheckpointError(f"quantization group size {group_size} does not divide a projection's input dim "
                                  f"{in_features}")
        self.tinygemm = tinygemm
        if tinygemm:
            packed, scales_zeros, _ = int4pack.empty(out_features, in_features, self.group_size, tinygemm)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_zeros", scales_zeros)
            return
        self.int8mm = int8pack_dtype is not None
        if self.int8mm:
            packed = int8pack.empty(out_features, in_features, int8pack_dtype)
            self.register_buffer("int8_weight", packed.weight)
            self.register_buffer("int8_scales", packed.scales)
            return
        groups = in_features // self.group_size
        self.register_buffer("qweight", torch.empty(out_features, in_features * bits // 32, dtype=torch.int32))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=torch.float32))
        self.register_buffer("zeros", torch.empty(out_features, groups, dtype=torch.uint8) if has_zeros else None)

    int8mm = False  # torch's INT8 CPU layout (model/int8pack.py)

    @property
    def weight(self) -> QuantizedWeight | int4pack.Int4PackedWeight | int8pack.Int8PackedWeight:
        if self.tinygemm:
            return int4pack.Int4PackedWeight(self.packed, self.scales_zeros, self.group_size)
        if self.int8mm:
            return int8pack.Int8PackedWeight(self.int8_weight, self.int8_scales)
        return QuantizedWeight(self.qweight, self.scales, self.zeros, self.bits, self.group_size)

    def load(self, w: QuantizedWeight, row: int = 0) -> None:
        """The weight, or rows [row, row + its rows) of it (a big projection quantized a block of
        rows at a time: loader._quantize_by_rows)."""
        rows, k = w.shape
        whole = row == 0 and rows == self.out_features
        if (k != self.in_features or w.bits != self.bits or row < 0 or row + rows > self.out_features
                or (self.tinygemm and not whole)):
            raise CheckpointError(f"quantized weight {w.shape} ({w.bits} bits) at row {row} does not fit "
                                  f"[{self.out_features}, {self.in_features}] ({self.bits} bits)")
        if self.tinygemm:
            device = self.packed.device
            packed = int4pack.pack(integers(w).to(device), zero_points(w).to(device), w.scales.to(device),
                                   self.group_size)
            self.packed.copy_(packed.packed)
            self.scales_zeros.copy_(packed.scales_zeros)
            return
        if self.int8mm:
            packed = int8pack.pack(integers(w), w.scales, self.int8_scales.dtype)
            self.int8_weight[row:row + rows].copy_(packed.weight)
            self.int8_scales[row:row + rows].copy_(packed.scales)
            return
        self.qweight[row:row + rows].copy_(w.qweight)
        self.scales[row:row + rows].copy_(w.scales)
        if self.zeros is not None:
            self.zeros[row:row + rows].copy_(w.zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tinygemm:
            if x.reshape(-1, x.shape[-1]).shape[0] <= int4pack.MAX_ROWS or not x.is_cuda or not self._fused(x):
                return int4pack.matmul(x, self.weight)
            from jetserve.engine.model.quant_kernels import dequantize_int4pack  # needs Triton, as a GPU has

            return F.linear(x, dequantize_int4pack(self.weight, x.dtype))
        if self.skinny(x) and not self.int8mm:
            return self.kernels.linear(x, self.weight)
        return self.product(x, self.weight)

    def product(self, x: torch.Tensor, weight: QuantizedWeight | int8pack.Int8PackedWeight) -> torch.Tensor:
        """x @ dequant(weight)^T off the fused kernels' rows (the weight, or rows of it: a draft
        vocabulary), as `Linear.product`."""
        if isinstance(weight, int8pack.Int8PackedWeight):
            return int8pack.matmul(x, weight)
        if self._fused(x):
            from jetserve.engine.model.quant_kernels import dequantized  # needs Triton, as a GPU has

            return float_product(x, weight, dequantized)
        return float_product(x, weight)

    def extra_repr(self) -> str:
        layout = f", tinygemm ({self.tinygemm})" if self.tinygemm else ", int8pack" if self.int8mm else ""
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group={self.group_size}{layout}"


class QuantEmbedding(KernelUser):
    """The token embedding of a model whose vocab projection is quantized and tied to it (Qwen3's
    small models): the table exists once, at the projection's bits, and a step's rows are
    dequantized as they are looked up (one kernel on a GPU), exactly as the projection sees them."""

    def __init__(self, head: QuantLinear, dtype: torch.dtype):
        super().__init__()
        self.head = [head]  # the model's lm_head, registered there: a list, so not a second time here
        self.dtype = dtype

    @property
    def weight(self) -> QuantizedWeight | int8pack.Int8PackedWeight:
        return self.head[0].weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if isinstance(self.weight, int8pack.Int8PackedWeight):
            rows = int8pack.rows(self.weight, flat, self.dtype)
        elif self._fused(self.weight.scales):
            from jetserve.engine.model.quant_kernels import dequantized  # needs Triton, as a GPU has

            rows = dequantized(self.weight, self.dtype, flat)
        else:
            rows = dequantize(quant_rows(self.weight, flat), self.dtype)
        return rows.view(*ids.shape, -1)

    def extra_repr(self) -> str:
        return f"tied to the quantized vocab projection, {self.weight.bits} bits, {self.dtype}"
