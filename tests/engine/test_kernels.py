"""The Triton kernels' arithmetic against plain torch: the skinny matmul with each prologue and
every tile shape it may pick, split-context paged attention. On a GPU they run compiled; without
one, in Triton's interpreter on CPU tensors (tests/conftest.py), so CI checks what the fused CUDA
path computes. Their speed is measured by `jetserve bench`, whole steps by test_cuda_graphs."""

import pytest
import torch
import torch.nn.functional as F

from tests.tools import compile_for_gpus, require_module

require_module("triton")

import triton  # noqa: E402

from jetserve.engine.model import kernels  # noqa: E402  (after the skip)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rms_norm(x, w, eps):
    y = x.float()
    return w * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


Tile = kernels.Tile
FMA_TILES = [Tile(4, 1024, 4), Tile(2, 4096, 4), Tile(16, 512, 4), Tile(8, 256, 8), Tile(2, 1024, 8, apart=True),
             Tile(8, 256, 8, stages=3)]
# from kernels._DOT_TILES: K in one tile, in loops, split over programs (in one tile or a loop each), the
# loops pipelined (Tile.stages)
DOT_TILES = [Tile(16, 256, 4, dot=True), Tile(64, 64, 4, dot=True), Tile(32, 128, 4, dot=True),
             Tile(16, 128, 4, 8, dot=True), Tile(16, 256, 4, 4, True, dot=True), Tile(32, 128, 4, 4, dot=True),
             Tile(64, 128, 4, dot=True, stages=3), Tile(32, 128, 4, 4, dot=True, stages=3)]
SPLIT_TILES = [Tile(4, 128, 4, 3), Tile(2, 256, 4, 2, True)]  # FMA tiles over K split: loops, a partial last split


# bf16: the interpreter truncates where GPUs round to nearest, so its results drift further.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2 if DEVICE == "cuda" else 1e-1)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 33, 64])
def test_skinny_matmul_prologues(dtype, tol, m):
    """Every row count up to SKINNY_MAX_ROWS in its kinds of tile (FMAs up to 8 rows, tensor-core
    dots from 1, rows padded to 16 below it): N and K not multiples of any tile (masked edges), K
    in one tile or in a loop (the norm's first pass), K split over programs whose partial sums are
    added after, the prologue in a kernel of its own; bf16 rounds where the torch path does."""
    # the interpreter's tl.dot returns garbage for bf16 operands (Triton 3.x): GPU only
    # (pipelined ones past 16 rows in 16 bits only: kernels.candidate_tiles)
    dots = [t for t in DOT_TILES if m <= 16 or not t.stages or dtype.itemsize == 2] \
        if dtype == torch.float32 or DEVICE == "cuda" else []
    if m > 8 and not dots:
        pytest.skip("bf16 tensor-core dots: GPU only")
    assert set(FMA_TILES) <= set(kernels._TILES) and set(DOT_TILES) <= set(kernels._DOT_TILES)
    assert m <= kernels.SKINNY_MAX_ROWS
    tiles = dots if m > 8 else FMA_TILES + SPLIT_TILES + dots
    assert set(dots) <= set(kernels.candidate_tiles(triton.next_power_of_2(m), kernels.NORM, dtype=dtype))
    torch.manual_seed(m)
    n, k, eps = 37, 600, 1e-6
    x, res = torch.randn(m, k, dtype=dtype, device=DEVICE), torch.randn(m, k, dtype=dtype, device=DEVICE)
    gate_up = torch.randn(m, 2 * k, dtype=dtype, device=DEVICE)
    w = torch.randn(n, k, dtype=dtype, device=DEVICE) / 8
    norm_w = torch.rand(k, dtype=dtype, device=DEVICE) + 0.5
    h = x + res
    expected = {
        kernels.PLAIN: F.linear(x, w),
        kernels.NORM: (F.linear(rms_norm(x, norm_w, eps), w), x),
        kernels.ADD_NORM: (F.linear(rms_norm(h, norm_w, eps), w), h),
        kernels.SILU_MUL: F.linear(F.silu(gate_up[:, :k]) * gate_up[:, k:], w),
    }
    inputs = {kernels.PLAIN: (x, None, None), kernels.NORM: (x, None, norm_w),
              kernels.ADD_NORM: (x, res, norm_w), kernels.SILU_MUL: (gate_up, None, None)}
    ran = set()
    for prologue, want in expected.items():
        inp, residual, nw = inputs[prologue]
        for tile in tiles:
            try:
                got = kernels._run(tile, prologue, inp, w, residual, nw, eps)
            except triton.runtime.errors.OutOfResources:  # fp32 dots of many rows on a GPU: never chosen there
                assert DEVICE == "cuda" and dtype == torch.float32 and tile.dot
                continue
            ran.add(tile)
            if isinstance(want, tuple):
                # The residual sum: exact (but for the interpreter's bf16 truncation).
                exact = dtype == torch.float32 or DEVICE == "cuda"
                torch.testing.assert_close(got[1], want[1], rtol=0 if exact else tol, atol=0 if exact else tol)
                got, want_out = got[0], want[0]
            else:
                want_out = want
            torch.testing.assert_close(got.float(), want_out.float(), rtol=tol, atol=tol, msg=f"{prologue} {tile}")
    assert ran  # some tile of each row count fits the GPU's shared memory


def reference_attention(q, k_cache, v_cache, tables, ctx_lens, q_len, block_size, scale):
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        b = t // q_len
        limit = max(ctx_lens[b] - q_len + t % q_len + 1, 1)
        slots = [tables[b][p // block_size] * block_size + p % block_size for p in range(limit)]
        keys, values = k_cache[slots].float(), v_cache[slots].float()  # [L, KVH, D]
        group = q.shape[1] // k_cache.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        weights = torch.einsum("hd,lhd->hl", q[t].float(), keys).mul(scale).softmax(-1)
        out[t] = torch.einsum("hl,lhd->hd", weights, values).to(q.dtype)
    return out


@pytest.mark.parametrize("splits", [1, 4, 16])
@pytest.mark.parametrize("q_len", [1, 3])
def test_paged_attention_splits(monkeypatch, splits, q_len):
    """Context split over programs and recombined by log-sum-exp equals one pass: contexts
    shorter than the splits (empty splits), not a multiple of a block, GQA, head_dim 24."""
    torch.manual_seed(splits + q_len)
    monkeypatch.setattr(kernels, "_num_splits", lambda programs, device: splits)
    block_size, kv_heads, heads, head_dim = 4, 2, 6, 24
    ctx_lens = [3, 1 + q_len, 70]
    tables = [[7, 1], [3], list(range(8, 8 + 18))]
    k_cache = torch.randn(30 * block_size, kv_heads, head_dim, device=DEVICE)
    v_cache = torch.randn(30 * block_size, kv_heads, head_dim, device=DEVICE)
    q = torch.randn(len(ctx_lens) * q_len, heads, head_dim, device=DEVICE)
    width = max(map(len, tables))
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    lens_t = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    got = kernels.paged_attention(q, k_cache, v_cache, table_t, lens_t, q_len, block_size, head_dim ** -0.5)
    want = reference_attention(q, k_cache, v_cache, tables, ctx_lens, q_len, block_size, head_dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("splits", [1, 4, 16])
@pytest.mark.parametrize("q_len", [1, 3])
def test_paged_attention_makes_q_and_the_new_keys_from_qkv(monkeypatch, splits, q_len):
    """A uniform step's attention from the qkv projection (`fresh`) gives what the norm + RoPE +
    KV store kernel followed by the attention gives, bit for bit in the interpreter, and writes
    the same keys and values into the cache, every new one before any program reads it (the new
    slots start as NaN): GQA (3 queries a kv head), head_dim 24, contexts shorter than the splits,
    new keys across two splits, a padded sequence as a graph pads (one key, the scratch slot).
    Against torch's norm, RoPE and softmax attention too."""
    from jetserve.engine.model.attention import FreshQKV, slot_mapping
    from jetserve.engine.model.qwen3 import RotaryEmbedding, apply_rope

    torch.manual_seed(splits + 10 * q_len)
    monkeypatch.setattr(kernels, "_num_splits", lambda programs, device: splits)
    block_size, kv_heads, heads, head_dim, eps, scratch = 4, 2, 6, 24, 1e-6, 29
    ctx_lens = [3, 1 + q_len, 65, 1]  # 65: at q_len 3 the new keys straddle the splits' bound at key 64
    tables = [[7, 1], [3], list(range(8, 8 + 18)), [scratch]]
    slots = slot_mapping(tables[:3], ctx_lens[:3], [q_len] * 3, block_size) + [scratch * block_size] * q_len
    positions = [c - q_len + j for c in ctx_lens[:3] for j in range(q_len)] + [0] * q_len
    cos, sin = RotaryEmbedding(head_dim, 10000.0, 128)(torch.tensor(positions), torch.float32)
    t = len(ctx_lens) * q_len
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device=DEVICE)
    q_w, k_w = torch.rand(head_dim, device=DEVICE) + 0.5, torch.rand(head_dim, device=DEVICE) + 0.5
    fresh = FreshQKV(qkv, q_w, k_w, cos.to(DEVICE), sin.to(DEVICE), torch.tensor(slots, dtype=torch.int32,
                                                                                  device=DEVICE), eps)
    k_cache = torch.randn(30 * block_size, kv_heads, head_dim, device=DEVICE)
    v_cache = torch.randn(30 * block_size, kv_heads, head_dim, device=DEVICE)
    k_cache[slots], v_cache[slots] = float("nan"), float("nan")
    width = max(map(len, tables))
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    lens_t = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5

    apart_k, apart_v = k_cache.clone(), v_cache.clone()
    q = kernels.qk_norm_rope_store(*fresh[:-1], apart_k, apart_v, eps, heads, kv_heads, head_dim)
    apart = kernels.paged_attention(q, apart_k, apart_v, table_t, lens_t, q_len, block_size, scale)
    fused = kernels.paged_attention(None, k_cache, v_cache, table_t, lens_t, q_len, block_size, scale, fresh=fresh)

    real = slice(0, 3 * q_len)  # the padded sequence's rows and its scratch slot hold anything
    kept = torch.ones(k_cache.shape[0], dtype=torch.bool)
    kept[scratch * block_size:] = False
    # the same arithmetic on tiles of other shapes: on a GPU their sums may round apart
    exact = dict(rtol=0, atol=0) if DEVICE == "cpu" else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[real], apart[real], **exact)
    torch.testing.assert_close(k_cache[kept], apart_k[kept], **exact)
    torch.testing.assert_close(v_cache[kept], apart_v[kept], rtol=0, atol=0)
    assert not fused[real].isnan().any()

    q_t, k_t, v_t = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    rope = fresh.cos.view(t, 1, head_dim), fresh.sin.view(t, 1, head_dim)
    want_q = apply_rope(rms_norm(q_t.view(t, heads, head_dim), q_w, eps), *rope)
    want_k = apply_rope(rms_norm(k_t.view(t, kv_heads, head_dim), k_w, eps), *rope)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache[slots[:3 * q_len]], want_k[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_cache[slots[:3 * q_len]], v_t[real].view(-1, kv_heads, head_dim), rtol=0, atol=0)
    want = reference_attention(want_q, k_cache, v_cache, tables, ctx_lens, q_len, block_size, scale)
    torch.testing.assert_close(fused[real], want[real], rtol=1e-4, atol=1e-4)


def test_paged_attention_compiles_for_hopper_and_orin():
    """The paged decode kernel compiles for sm_90 and Jetson Orin's sm_87 in each form a step
    launches (q given, listed tokens, q and the new keys made from the qkv projection at a
    decode and at a verify; 2 and 4 queries a kv head), with no register spills; the forms that
    make q synchronize their threads more often (the per-head norms' reductions, and the
    barrier between storing the new keys and reading the cache), and their key loop stays
    within a tenth of the given form's (the work added comes before it)."""
    done = compile_for_gpus("attention")
    lines = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("attention ")]
    assert len(lines) == 2 * 4 * 2, done.stdout
    seen = {(arch, form, group): (int(bars), int(loop)) for arch, form, group, _, bars, _, loop in lines}
    assert all(spills == "0" for *_, spills, _, _, _ in lines), done.stdout
    for (arch, form, group), (bars, loop) in seen.items():
        given_bars, given_loop = seen[arch, "given", group]
        if form in ("decode", "verify"):
            assert bars > given_bars and loop <= 1.1 * given_loop, (arch, form, group, done.stdout)


def test_untimed_where_graphs_are_off():
    """Timing tiles captures CUDA graphs; with graphs off (the runner makes its kernels without
    `tile_timing`) a big weight takes the first tile that fits, untimed; each engine's choices
    are its own."""
    untimed, other = kernels.FusedKernels(tile_timing=False), kernels.FusedKernels(tile_timing=False)
    x = torch.randn(2, 256, device=DEVICE)
    w = torch.randn(300, 256, device=DEVICE)  # 300 KB in fp32: past the untimed size
    pdl = kernels.pdl_supported(x.device)  # Hopper's candidates come with PDL first
    torch.testing.assert_close(untimed.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert list(untimed.chosen.values()) == [kernels.candidate_tiles(2, pdl=pdl)[1]] and untimed.tuning_times == {}
    assert other.chosen == {}
    other.linear(torch.randn(20, 256, device=DEVICE), w)  # 20 rows: a tensor-core tile
    assert list(other.chosen.values()) == kernels.with_pdl([kernels._DOT_TILES[0]], pdl)[:1]


def test_shapes_after_freeze_are_recorded_untimed():
    """After start-up tuning no shape is timed: a new one takes the first tile that fits and is
    recorded, so the engine's test can tell that start-up missed it."""
    tuned = kernels.FusedKernels(tile_timing=True)
    tuned.freeze()
    x, w = torch.randn(3, 256, device=DEVICE), torch.randn(300, 256, device=DEVICE)
    torch.testing.assert_close(tuned.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert tuned.untuned == {(kernels.PLAIN, 4, 300, 256, torch.float32)} and tuned.tuning_times == {}


def test_candidates_with_and_without_pdl():
    """Where the GPU has programmatic dependent launches every tile is tried with them, with
    them and the L2 prefetch, and main's plain tiles (K whole, the prologue fused) also without;
    elsewhere none has either; a plain product has no prologue to run apart."""
    plain = kernels.candidate_tiles(1, kernels.NORM)
    assert plain[0] is None and not any(t.pdl or t.prefetch for t in plain[1:])
    both = kernels.candidate_tiles(1, kernels.NORM, pdl=True)
    assert [t._replace(pdl=False) for t in both[1:] if t.pdl and not t.prefetch] == plain[1:]
    assert [t._replace(pdl=False, prefetch=False) for t in both[1:] if t.prefetch] == plain[1:]
    assert all(t.pdl for t in both[1:] if t.prefetch)
    assert [t for t in both[1:] if not t.pdl] == [t for t in plain[1:] if t.split_k == 1 and not t.apart]
    assert any(t.apart for t in plain[1:]) and not any(t.apart for t in kernels.candidate_tiles(1, pdl=True)[1:])
    assert any(t.split_k > 1 for t in kernels.candidate_tiles(32, kernels.PLAIN)[1:])
    # pipelined tiles (their stages hold the input rows too): at every row count in 16 bits, up to 16 rows in
    # fp32; tensor-core tiles from one row
    assert {t.stages > 0 for t in kernels.candidate_tiles(16)[1:]} == {True, False}
    assert any(t.stages for t in kernels.candidate_tiles(64)[1:]) and any(t.stages for t in kernels.candidate_tiles(
        16, dtype=torch.float32)[1:])
    assert not any(t.stages for rows in (32, 64) for t in kernels.candidate_tiles(rows, dtype=torch.float32)[1:])
    assert any(t.dot for t in plain[1:]) and any(not t.dot for t in plain[1:])


def test_pipelined_tiles_copy_their_weights_asynchronously_on_hopper_and_orin():
    """A tile with stages (Tile.stages) compiles, for sm_90 and Jetson Orin's sm_87, to an inner
    loop that copies global memory to shared memory asynchronously (cp.async: what keeps several
    steps' weights in flight), for the bf16 FMA and tensor-core loops and the quantized one-row
    and tensor-core ones; the quantized and FMA loops' register prefetch (stages 0) does not. Every
    pipelined bf16 candidate at 64 rows, with each prologue it fuses, and each pipelined quantized
    tensor-core one at 16 rows fits an Orin's shared memory. Compiled
    as a launch compiles them (aligned pointers): unaligned, no load is pipelined at all."""
    done = compile_for_gpus("pipelined", timeout=600)
    sizes = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("shared ")]
    assert len(sizes) >= 8 and all(int(b) <= 163 * 1024 for *_, b in sizes), sizes  # what an Orin gives a program
    assert {name.split("-")[0] for name, *_ in sizes if name.startswith("int")} == {"int4", "int8"}
    lines = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("async ")]
    assert len(lines) == 2 * 2 * 6, done.stdout  # archs x stages x kernels
    for name, arch, stages, copies in lines:
        if stages != "0":
            assert copies == "yes", (name, arch, stages)
        elif name != "bf16-dot":  # the dot's register prefetch pipelines its inputs, not its weights
            assert copies == "no", (name, arch, stages)



def test_prefetching_tiles_ask_l2_before_they_wait_and_keep_their_loop_on_hopper_and_orin():
    """Tile.prefetch compiled for sm_90 and sm_87 as a launch compiles it: the bf16 FMA and
    tensor-core products, the INT4 one-row, tensor-core and FMA ones (groups with zero points)
    issue L2 prefetches (CCTL.E.PF2) for their weights, and for the INT4 ones their scales and
    zero points too; on Hopper before they wait for the previous kernel (PDL); their inner loop
    no longer than without the prefetch, which stays out of it."""
    done = compile_for_gpus("prefetched", timeout=600)
    lines = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("prefetch ")]
    assert len(lines) == 2 * 5, done.stdout  # archs x kernels
    for name, arch, prefetches, before, loop, without in lines:
        assert int(prefetches) >= (1 if name.startswith("bf16") else 3), (name, arch)
        assert before == ("yes" if arch == "sm_90" else "-"), (name, arch)
        assert int(loop) <= int(without) * 1.02, (name, arch, loop, without)


def _lines(t: torch.Tensor, rows: range, lo: int, hi: int) -> set[int]:
    """The 128-byte lines that columns [lo, hi) of t's rows `rows` lie on."""
    size, at = t.element_size(), t.data_ptr()
    return {line for r in rows for line in range((at + (r * t.shape[1] + lo) * size) // 128,
                                                 (at + (r * t.shape[1] + hi) * size - 1) // 128 + 1)}


@pytest.mark.skipif(DEVICE == "cuda", reason="reads the prefetches' addresses in Triton's interpreter")
def test_a_prefetching_tile_asks_l2_for_every_line_of_its_weights_and_nothing_else(monkeypatch):
    """Tile.prefetch, each kernel that takes it, the prefetch instruction recorded (the
    interpreter runs no inline assembly): each program asks for exactly the lines of its share
    of the weights, with its groups' scales and zero points (K split with a partial last split,
    N past the last tile's rows, rows that start inside a line); the results are exactly the
    same tile's without it."""
    from triton.runtime.interpreter import interpreter_builder

    from jetserve.engine.model import quant, quant_kernels

    asked: dict[tuple, set[int]] = {}

    def record(ptrs):
        asked.setdefault(interpreter_builder.grid_idx[:2], set()).update(int(a) // 128 for a in ptrs.handle.data.ravel())

    monkeypatch.setattr(kernels, "_prefetch", record)
    for module in (kernels, quant_kernels):
        monkeypatch.setattr(module, "prefetching", lambda tile: tile.prefetch)
    torch.manual_seed(0)
    # Rows start 16 bytes into a line, and the 64-row tile's prefetch asks for 2 columns a row an
    # iteration, a line apart: its rows are 2 iterations long, so a row's last line begins after
    # the last column asked a line apart, and only the clamp to the row's end reaches it.
    w = torch.randn(301 * 256 + 8, dtype=torch.bfloat16)[8:].view(301, 256)
    cases = [(Tile(4, 128, 4, 3, prefetch=True), 1, w), (Tile(64, 64, 4, dot=True, stages=3, prefetch=True), 3, w)]
    for bits, group, sym, tile, m in ((4, 32, False, Tile(16, 16, 2, 2, one_row=True, prefetch=True), 1),
                                      (4, 128, False, Tile(16, 16, 4, 3, dot=True, prefetch=True), 3),
                                      (8, -1, True, Tile(16, 16, 4, 3, dot=True, prefetch=True), 1),
                                      (8, 32, True, Tile(8, 32, 1, 2, prefetch=True), 3)):
        cases.append((tile, m, quant.quantize(torch.randn(37, 1280) / 8, bits, group, sym)))
    for tile, m, weight in cases:
        x = torch.randn(m, weight.shape[1], dtype=torch.bfloat16)
        quantized = isinstance(weight, quant.QuantizedWeight)
        run = quant_kernels.quant_matmul if quantized else kernels._run
        asked.clear()
        got = run(tile, kernels.PLAIN, x, weight, None, None, 1e-6)
        n, width = weight.shape[0], (weight.qweight if quantized else weight).shape[1]
        per, splits = kernels.split_k(width, tile, tile.block_k)
        assert len(asked) == triton.cdiv(n, tile.block_n) * splits, tile
        for (i, j), lines in asked.items():
            rows, lo, hi = range(i * tile.block_n, min(n, (i + 1) * tile.block_n)), j * per, min(width, (j + 1) * per)
            if not quantized:
                want = _lines(weight, rows, lo, hi)
            else:
                want = _lines(weight.qweight, rows, lo, hi)
                if weight.scales.shape[1] > 1:  # groups: theirs, a word holding 32 // bits inputs
                    fields = 32 // weight.bits
                    g_lo, g_hi = lo * fields // weight.group_size, triton.cdiv(hi * fields, weight.group_size)
                    for t in (weight.scales, weight.zeros):
                        want |= _lines(t, rows, g_lo, g_hi) if t is not None else set()
            assert lines == want, (tile, i, j, len(lines - want), len(want - lines))
        assert torch.equal(got, run(tile._replace(prefetch=False), kernels.PLAIN, x, weight, None, None, 1e-6)), tile
