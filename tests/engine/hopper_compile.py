"""Compile the speculative step's and the draw's Triton kernels for Hopper (sm_90) and Jetson Orin
(sm_87) with Triton's own compiler and ptxas, no GPU needed: Triton's interpreter (the CPU tests)
accepts code the compiler refuses, e.g. a plain global read inside a kernel. Run as a script (the interpreter
must be off): python -m tests.engine.hopper_compile; with the argument `quant`, the one-row
W4A16/W8A16 kernel's variants instead; with `quant_dot`, the tensor-core one's for sm_90 and for
Jetson Orin (sm_87), with its instructions a weight in the inner loop (tools/sass_count.py); with
`pipelined`, the pipelined tiles' (kernels.Tile.stages) of the bf16 and quantized products; with
`prefetched`, the products' L2 prefetch (kernels.Tile.prefetch); with `mma`, the quantized MMA kernel's
layout and inner loop (model/mma_kernels.py)."""

import functools
import inspect
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from jetserve.engine.model import kernels, quant_kernels, sampling_kernels, spec_kernels


def compile_for_hopper(fn, types: dict, constants: dict, arch: int = 90, num_warps: int = 4):
    """`fn` for sm_`arch` as a launch compiles it: its pointers 16-byte aligned (the JIT
    specializes on that, and torch's allocations are), so loads vectorize and pipeline."""
    signature, constexprs, aligned = {}, {}, {}
    for i, name in enumerate(inspect.signature(fn.fn).parameters):
        if name in constants:
            signature[name], constexprs[(i,)] = "constexpr", constants[name]
        else:
            signature[name] = types.get(name, "i32")  # unnamed: an int32 scalar
            if signature[name].startswith("*"):
                aligned[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=aligned),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def main() -> None:
    for arch in (90, 87):  # Hopper, and Jetson Orin
        speculative(functools.partial(compile_for_hopper, arch=arch))
    print("compiled")


def speculative(compile_for) -> None:
    """Every kernel a speculative or decode graph adds, compiled by `compile_for`."""
    for logits in ("*fp32", "*bf16"):  # decode graphs draw from fp32 logits, speculative ones from bf16
        for positions in ("*i32", "*i64"):  # a graph's static positions, an eager step's
            for floor in (False, True):
                compile_for(sampling_kernels._race_kernel,
                            dict(logits_ptr=logits, top_ptr=logits, greedy_ptr="*i64",
                                 temperature_ptr="*fp32", min_p_ptr="*fp32", floor_ptr="*fp32",
                                 seed_ptr="*i32", position_ptr=positions, score_ptr="*fp32",
                                 index_ptr="*i32"),
                            dict(HAS_FLOOR=floor, V_BLOCK=2048, CHUNK=4096))
    compile_for(sampling_kernels._race_final_kernel, dict(score_ptr="*fp32", index_ptr="*i32", out_ptr="*i64"),
                dict(S_BLOCK=64))
    for q, steps in ((4, 2), (2, 0)):
        compile_for(spec_kernels._accept_chain_kernel,
                    dict(ids_ptr="*i32", target_ptr="*i64", positions_ptr="*i32", tables_ptr="*i32",
                         ctx_ptr="*i32", x_ptr="*bf16", res_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16",
                         packed_ptr="*i64", x_out_ptr="*bf16", res_out_ptr="*bf16", chain_slot_ptr="*i32",
                         chain_ctx_ptr="*i32", chain_cos_ptr="*bf16", chain_sin_ptr="*bf16"),
                    dict(Q=q, Q_PAD=q, STEPS=steps, HIDDEN=256, HIDDEN_PAD=256, HEAD_DIM=64, HEAD_PAD=64))
    for logits in ("*fp32", "*bf16"):
        compile_for(sampling_kernels._argmax_splits_kernel,
                    dict(logits_ptr=logits, score_ptr="*fp32", index_ptr="*i32"), dict(V_BLOCK=2048, CHUNK=4096))
    # Draft tokens from logits scanned in the kernel (bf16) or from split argmaxes (fp32 scores), mapped
    # through a draft vocabulary's ids or not; and from ids.
    for from_logits, split, mapped in ((True, True, True), (True, False, False), (True, False, True),
                                       (False, False, False)):
        scan = dict(SPLIT=split, S_BLOCK=64 if split else 2, V_BLOCK=16 if split else 4096,
                    CHUNK=16 if split else 8192)
        score = "*fp32" if split else "*bf16"
        # the embedding a float table, or (from ids) an INT8 one (a quantized vocab projection's)
        for bits in (0, 8):
            table = dict(embed_ptr="*i32", es_ptr="*fp32", ez_ptr="*fp32") if bits else dict(
                embed_ptr="*bf16", es_ptr="*bf16", ez_ptr="*bf16")
            compile_for(spec_kernels._draft_input_kernel,
                        dict(tokens_ptr=score if from_logits else "*i64", index_ptr="*i32" if split else score,
                             ids_ptr="*i64", hidden_ptr="*bf16", **table, enorm_ptr="*bf16",
                             hnorm_ptr="*bf16", prev_norm_ptr="*bf16", out_ptr="*bf16",
                             tokens_out_ptr="*i64" if from_logits else "*bf16", eps_e="fp32", eps_h="fp32",
                             eps_prev="fp32"),
                        dict(HIDDEN=256, HIDDEN_PAD=256, FROM_LOGITS=from_logits, NORM_HIDDEN=from_logits,
                             MAP=mapped, EMBED_BITS=bits, EMBED_GROUP=256, EMBED_ZEROS=False, **scan))
        if from_logits:
            compile_for(spec_kernels._argmax_into_kernel,
                        dict(score_ptr=score, index_ptr="*i32" if split else score, ids_ptr="*i64",
                             out_ptr="*i64"), dict(MAP=mapped, **scan))
    for q in (1, 4):
        compile_for(spec_kernels._chain_inputs_kernel,
                    dict(flags_ptr="*i32", packed_ptr="*i64", ids_ptr="*i32", positions_ptr="*i32",
                         slots_ptr="*i32", ctx_ptr="*i32", tables_ptr="*i32"),
                    dict(Q=q, Q_PAD=q))


def quant() -> None:
    """The one-row quantized kernel: INT4 with zero points and groups, INT8 per channel and
    symmetric; every prologue, with PDL or rows past N and K split, a step within a group or over
    several, the register prefetch or the pipeline; bf16 (and fp32) activations."""
    cases = [(bits, group, zeros, prologue, "*bf16") for bits, group, zeros in ((4, 128, True), (8, 1024, False))
             for prologue in range(4)] + [(4, 128, True, 0, "*fp32")]
    for i, (bits, group, zeros, prologue, act) in enumerate(cases):
        even, split, pdl = (True, 1, True) if i % 2 else (False, 2, False)
        compile_for_hopper(quant_kernels._quant_gemv_kernel,
                           dict(x_ptr=act, res_ptr=act, norm_w_ptr=act, qw_ptr="*i32", s_ptr="*fp32",
                                z_ptr="*u8" if zeros else "*fp32", out_ptr=act if split == 1 else "*fp32",
                                res_out_ptr=act, eps="fp32"),
                           dict(K=1024, NORM=prologue in (1, 2), ADD=prologue == 2, SILU=prologue == 3, BITS=bits,
                                GROUP=group, HAS_ZEROS=zeros, BLOCK_N=64, BLOCK_W=64 if i % 3 == 0 else 16 if bits == 4 else 32,
                                NORM_BLOCK=1024, KW_SPLIT=1024 * bits // 32 // split, EVEN_N=even, PDL=pdl,
                                STAGES=3 if i % 4 == 1 else 0, PREFETCH=i % 3 == 1))
    # the dequantizing pass: a prefill's whole weight, or a quantized embedding's rows (GATHER), Hopper and Orin
    for arch in (90, 87):
        for bits, group, zeros, gather in ((8, 1024, False, True), (4, 128, True, False), (4, 128, True, True)):
            compile_for_hopper(quant_kernels._dequantize_span_kernel,
                               dict(qw_ptr="*i32", s_ptr="*fp32", z_ptr="*u8" if zeros else "*fp32",
                                    ids_ptr="*i64" if gather else "*fp32", out_ptr="*bf16"),
                               dict(BITS=bits, GROUP=group, HAS_ZEROS=zeros, GATHER=gather, BLOCK_N=16), arch)
    print("compiled")


def quant_dot() -> None:
    """The tensor-core quantized kernel for sm_90 and sm_87: INT4 with zero points in groups,
    INT8 per channel, every prologue, bf16 and fp16 inputs, 1 to 64 rows (INT8 at 32: a vocab
    projection's batch), K split; then the
    inner loop's instructions a weight of INT4 and INT8 plain products on both (printed, one
    line each: `sass sm_<arch> <bits> <per weight>`)."""
    from tools.sass_count import inner_loop

    cases = [(bits, group, zeros, prologue, act, rows) for bits, group, zeros in ((4, 128, True), (8, 1024, False))
             for prologue, act, rows in ((0, "*bf16", 1), (1, "*bf16", 1), (2, "*fp16", 8), (3, "*bf16", 1),
                                         (0, "*fp16", 8))] + [(4, 256, False, 0, "*bf16", 64),
                                                              (8, 1024, False, 0, "*bf16", 32)]  # a vocab's batch
    for arch in (90, 87):
        for i, (bits, group, zeros, prologue, act, rows) in enumerate(cases):
            split = 1 if i % 2 else 2
            compiled = compile_for_hopper(
                quant_kernels._quant_dot_kernel,
                dict(x_ptr=act, res_ptr=act, norm_w_ptr=act, qw_ptr="*i32", s_ptr="*fp32",
                     z_ptr="*u8" if zeros else "*fp32", out_ptr=act if split == 1 else "*fp32", res_out_ptr=act,
                     eps="fp32"),
                dict(K=1024, NORM=prologue in (1, 2), ADD=prologue == 2, SILU=prologue == 3, BITS=bits, GROUP=group,
                     HAS_ZEROS=zeros, BLOCK_M=rows, BLOCK_N=64, BLOCK_W=16, NORM_BLOCK=1024 // max(rows, 16),
                     KW_SPLIT=1024 * bits // 32 // split, PDL=arch >= 90, DOT_M=max(rows, 16), INTERPRETED=False,
                     STAGES=0, PREFETCH=i % 3 == 1),
                arch)
            if prologue == 0 and rows == 1:  # 64 x 16 words a step over 128 threads
                print(f"sass sm_{arch} {bits} {len(inner_loop(compiled.asm['sass'])) / (64 * 16 * 32 // bits / 128):.2f}")
    print("compiled")


def pipelined() -> None:
    """The pipelined tiles (kernels.Tile.stages) of the bf16 skinny product (FMA and tensor-core
    loops, every prologue) and of the quantized one-row and tensor-core ones (INT4 in groups,
    INT8 per channel), for sm_90 and sm_87: one line each, `async <kernel> sm_<arch> <stages> <yes|no>`,
    whether the inner loop copies its weights asynchronously (cp.async, LDGSTS), which is what
    the stages are for; stages 0, the register prefetch, for comparison. First, `shared <tile>
    <prologue> <bytes>`: the shared memory each pipelined bf16 candidate at 64 rows takes on sm_87,
    and each pipelined quantized tensor-core one at 16 rows (its prologue fused: the most it holds)."""
    from tools.sass_count import inner_loop

    def line(name, arch, stages, compiled):
        body = inner_loop(compiled.asm["sass"])
        print(f"async {name} sm_{arch} {stages} {'yes' if any(op.startswith('LDGSTS') for op in body) else 'no'}")

    act = dict(x_ptr="*bf16", res_ptr="*bf16", norm_w_ptr="*bf16", res_out_ptr="*bf16", eps="fp32")
    for prologue in range(4):  # shared memory of the pipelined bf16 candidates at their most rows, on an Orin
        for tile in {t._replace(pdl=False, prefetch=False) for t in kernels.candidate_tiles(64, prologue) if t and t.stages}:
            fused = 0 if tile.apart else prologue
            compiled = compile_for_hopper(
                kernels._skinny_matmul_kernel, dict(act, w_ptr="*bf16", out_ptr="*bf16"),
                dict(K=4096, NORM=fused in (1, 2), ADD=fused == 2, SILU=fused == 3, DOT=True, IEEE=False, BLOCK_M=64,
                     BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, K_SPLIT=4096 // tile.split_k, PDL=False,
                     STAGES=tile.stages, PREFETCH=False), 87, tile.warps)
            print(f"shared {tile.block_n}x{tile.block_k}x{tile.split_k} {prologue} {compiled.metadata.shared}")
    for tile in {t._replace(apart=False) for t in quant_kernels.DOT_TILES if t.stages}:  # quantized, at 16 rows
        for bits, group, zeros in ((4, 128, True), (8, 4096, False)):
            if group * bits // 32 % tile.block_k == 0:  # a step within a group
                compiled = compile_for_hopper(
                    quant_kernels._quant_dot_kernel,
                    dict(act, qw_ptr="*i32", s_ptr="*fp32", z_ptr="*u8" if zeros else "*fp32", out_ptr="*bf16"),
                    dict(K=4096, NORM=True, ADD=True, SILU=False, BITS=bits, GROUP=group, HAS_ZEROS=zeros, BLOCK_M=16,
                         BLOCK_N=tile.block_n, BLOCK_W=tile.block_k, NORM_BLOCK=256,
                         KW_SPLIT=4096 * bits // 32 // tile.split_k, PDL=False, DOT_M=16, INTERPRETED=False,
                         STAGES=tile.stages, PREFETCH=False), 87, tile.warps)
                print(f"shared int{bits}-{tile.block_n}x{tile.block_k}x{tile.split_k} 2 {compiled.metadata.shared}")
    for arch in (90, 87):
        for stages in (0, 3):
            for i, (dot, block_m, block_n, block_k, warps) in enumerate(((False, 1, 8, 256, 8), (True, 16, 64, 128, 4))):
                for prologue in range(4):
                    compiled = compile_for_hopper(
                        kernels._skinny_matmul_kernel, dict(act, w_ptr="*bf16", out_ptr="*bf16"),
                        dict(K=4096, NORM=prologue in (1, 2), ADD=prologue == 2, SILU=prologue == 3, DOT=dot,
                             IEEE=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_SPLIT=4096,
                             PDL=arch >= 90 and i == 0, STAGES=stages, PREFETCH=False), arch, warps)
                    if prologue == 0:
                        line("bf16-dot" if dot else "bf16-fma", arch, stages, compiled)
            for bits, group, zeros in ((4, 128, True), (8, 4096, False)):
                compiled = compile_for_hopper(
                    quant_kernels._quant_gemv_kernel,
                    dict(act, qw_ptr="*i32", s_ptr="*fp32", z_ptr="*u8" if zeros else "*fp32", out_ptr="*bf16"),
                    dict(K=4096, NORM=False, ADD=False, SILU=False, BITS=bits, GROUP=group, HAS_ZEROS=zeros, BLOCK_N=32,
                         BLOCK_W=64, NORM_BLOCK=1024, KW_SPLIT=4096 * bits // 32, EVEN_N=True, PDL=arch >= 90,
                         STAGES=stages, PREFETCH=False), arch)
                line(f"int{bits}-gemv", arch, stages, compiled)
                compiled = compile_for_hopper(
                    quant_kernels._quant_dot_kernel,
                    dict(act, qw_ptr="*i32", s_ptr="*fp32", z_ptr="*u8" if zeros else "*fp32", out_ptr="*bf16"),
                    dict(K=4096, NORM=False, ADD=False, SILU=False, BITS=bits, GROUP=group, HAS_ZEROS=zeros, BLOCK_M=1,
                         BLOCK_N=64, BLOCK_W=16, NORM_BLOCK=1024, KW_SPLIT=4096 * bits // 32, PDL=arch >= 90, DOT_M=16,
                         INTERPRETED=False, STAGES=stages, PREFETCH=False), arch)
                line(f"int{bits}-dot", arch, stages, compiled)
    print("compiled")


def prefetched() -> None:
    """Each product kernel with its L2 prefetch (kernels.Tile.prefetch) and without, for sm_90
    (with PDL) and sm_87: one line each, `prefetch <kernel> sm_<arch> <prefetches> <before the
    wait: yes|no|-> <loop instructions> <without the prefetch>`: the prefetch instructions
    (CCTL.E.PF2) in the SASS, whether the PTX asks for them before it waits for the previous
    kernel, and the inner loop's length with and without them (the prefetch is not in the loop)."""
    from tools.sass_count import inner_loop

    act = dict(x_ptr="*bf16", res_ptr="*bf16", norm_w_ptr="*bf16", res_out_ptr="*bf16", eps="fp32")
    quantized = dict(act, qw_ptr="*i32", s_ptr="*fp32", z_ptr="*u8", out_ptr="*bf16")
    int4 = dict(K=4096, NORM=False, ADD=False, SILU=False, BITS=4, GROUP=128, HAS_ZEROS=True, NORM_BLOCK=1024,
                KW_SPLIT=512)
    kernels_ = {  # name: kernel, argument types, constants, warps
        "bf16-fma": (kernels._skinny_matmul_kernel, dict(act, w_ptr="*bf16", out_ptr="*bf16"),
                     dict(K=4096, NORM=True, ADD=True, SILU=False, DOT=False, IEEE=False, BLOCK_M=1, BLOCK_N=4,
                          BLOCK_K=1024, K_SPLIT=4096, STAGES=0), 4),
        "bf16-dot": (kernels._skinny_matmul_kernel, dict(act, w_ptr="*bf16", out_ptr="*bf16"),
                     dict(K=4096, NORM=False, ADD=False, SILU=False, DOT=True, IEEE=False, BLOCK_M=16, BLOCK_N=64,
                          BLOCK_K=128, K_SPLIT=4096, STAGES=3), 4),
        "int4-gemv": (quant_kernels._quant_gemv_kernel, quantized,
                      dict(int4, BLOCK_N=32, BLOCK_W=64, EVEN_N=True, STAGES=0), 4),
        "int4-dot": (quant_kernels._quant_dot_kernel, quantized,
                     dict(int4, BLOCK_M=1, BLOCK_N=64, BLOCK_W=16, DOT_M=16, INTERPRETED=False, STAGES=4), 4),
        "int4-fma": (quant_kernels._quant_skinny_kernel, quantized, dict(int4, BLOCK_M=2, BLOCK_N=8, BLOCK_W=128), 4),
    }
    for arch in (90, 87):
        for name, (kernel, types, constants, warps) in kernels_.items():
            meta = dict(constants, PDL=arch >= 90)
            on = compile_for_hopper(kernel, types, dict(meta, PREFETCH=True), arch, warps)
            off = compile_for_hopper(kernel, types, dict(meta, PREFETCH=False), arch, warps)
            ptx = on.asm["ptx"]
            wait = ptx.find("griddepcontrol.wait")
            before = "-" if wait < 0 else "yes" if 0 <= ptx.find("prefetch.global.L2") < wait else "no"
            loops = len(inner_loop(on.asm["sass"])), len(inner_loop(off.asm["sass"]))
            print(f"prefetch {name} sm_{arch} {on.asm['sass'].count('CCTL.E.PF2')} {before} {loops[0]} {loops[1]}")
    print("compiled")


def attention() -> None:
    """The paged decode kernel for sm_90 and sm_87 in each form a step launches: q given (`given`),
    listed tokens (`listed`), q and the new keys made from the qkv projection at a decode
    (`decode`, one new key a program at most) and at a verify (`verify`). One line each,
    `attention sm_<arch> <form> <GROUP> <local memory loads and stores (spills)> <barriers>
    <instructions> <instructions in the key loop>`."""
    from tools.sass_count import _INSTR, inner_loop

    types = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", tables_ptr="*i32", ctx_ptr="*i32",
                 rows_ptr="*i32", out_ptr="*bf16", part_ptr="*fp32", lse_ptr="*fp32", qkv_ptr="*bf16",
                 qw_ptr="*bf16", kw_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", slot_ptr="*i32",
                 scale="fp32", eps="fp32")
    forms = {"given": (False, False, 1), "listed": (False, True, 1), "decode": (True, False, 1),
             "verify": (True, False, 16)}
    for arch in (90, 87):
        for (form, (fresh, per_token, rows)), group in [(f, g) for f in forms.items() for g in (2, 4)]:
            compiled = compile_for_hopper(
                kernels._paged_attention_kernel, types,
                dict(GROUP=group, GROUP_PAD=16, NUM_KV_HEADS=8, HEAD_DIM=128, HEAD_PAD=128,
                     BLOCK_SIZE=16, BLOCK_N=32, SPLITS=4, IEEE=False, PER_TOKEN=per_token, FRESH=fresh,
                     FRESH_ROWS=rows), arch)
            sass = compiled.asm["sass"]
            spills = sum(sass.count(op) for op in ("LDL", "STL"))
            size = sum(1 for line in sass.splitlines() if _INSTR.match(line))
            print(f"attention sm_{arch} {form} {group} {spills} {sass.count('BAR.SYNC')} {size} "
                  f"{len(inner_loop(sass))}")
    print("compiled")


def mma() -> None:
    """The quantized MMA kernel (model/mma_kernels.py) for sm_90 and sm_87, INT4 and INT8, bf16 and
    fp16 inputs, every warp count and depth its tiles take, zero points in groups and symmetric one
    group a row (INT8 the other way round), K whole and split, one tile of 8 input rows and two (at
    the depths offered for two): the layout its PTX assumes (one line each: `layout sm_<arch>
    <warps> <ok>`), then its inner loop (`loop sm_<arch> int<bits> <warps> <depth> <instructions a
    weight> <HMMA> <shared-memory ops>`)."""
    from jetserve.engine.model import mma_kernels
    from jetserve.engine.model.quant_kernels import MMA_MAX_DEPTH_TWO_TILES, MMA_TILES
    from tools.sass_count import inner_loop

    for arch in (90, 87):
        for warps, depth in sorted({(t.warps, t.block_k // mma_kernels.SPAN_COLUMNS) for t in MMA_TILES}):
            for bits, act, group, zeros, split, tiles in ((4, "*bf16", 128, True, 20, 1), (4, "*fp16", 2560, False, 4, 2),
                                                          (8, "*bf16", 2560, False, 40, 1), (8, "*fp16", 64, True, 8, 2)):
                if tiles == 2 and depth > MMA_MAX_DEPTH_TWO_TILES:
                    continue
                compiled = compile_for_hopper(
                    mma_kernels._quant_mma_kernel,
                    dict(x_ptr=act, qw_ptr="*i32", s_ptr="*fp32", z_ptr="*u8" if zeros else "*fp32",
                         out_ptr=act if split == 2560 // (512 // bits) else "*fp32", M="i32", N="i32"),
                    dict(K=2560, BITS=bits, GROUP=group, HAS_ZEROS=zeros, SLOTS=warps * depth, SPANS_SPLIT=split,
                         INPUT_TILES=tiles, PDL=arch >= 90, INTERPRETED=False),
                    arch, num_warps=warps)
                layout = mma_kernels.operand_layout(compiled.asm["ttgir"])
                print(f"layout sm_{arch} {warps} {layout == mma_kernels.EXPECTED_LAYOUT.format(warps=warps)}")
                if tiles == 1:  # K whole in one program: a loop of many steps
                    body = inner_loop(compiled.asm["sass"])
                    shared = sum(op.startswith(("LDS", "STS", "LDSM")) for op in body)
                    # a thread's step: `depth` spans of two rows' four words, 32 bits / `bits` weights a word
                    weights = 8 * 32 // bits * depth
                    print(f"loop sm_{arch} int{bits} {warps} {depth} {len(body) / weights:.2f} "
                          f"{sum(op.startswith('HMMA') for op in body)} {shared}")
    print("compiled")


if __name__ == "__main__":
    {"mma": mma, "quant": quant, "quant_dot": quant_dot, "pipelined": pipelined, "prefetched": prefetched,
     "attention": attention}.get(
        sys.argv[1] if sys.argv[1:] else "", main)()
