"""Mixed-step graphs and start-up tuning, on the CPU: the kernels run in Triton's interpreter
(tests/conftest.py), the graphs' work runs eagerly over their static inputs — what a capture
records, with the same padding. On the GPU, test_cuda_graphs replays the captured graphs."""

import pytest
import torch

from tests.tools import require_module

require_module("triton")

from jetserve.engine.config import CUDAGraphConfig, EngineArgs, token_sizes  # noqa: E402
from jetserve.engine.cuda_graphs import CUDAGraphs, MixedStepGraphs  # noqa: E402
from jetserve.engine.model import attention  # noqa: E402
from jetserve.engine.model.attention import AttentionMetadata  # noqa: E402
from jetserve.engine.model.kernels import SKINNY_MAX_ROWS, FusedKernels  # noqa: E402
from jetserve.engine.model.loader import load_model  # noqa: E402
from jetserve.engine.runner import skinny_row_counts, tune_kernels  # noqa: E402

from tests.engine.builders import build_drafting_model, build_qwen3  # noqa: E402

# One layer, two query heads on one kv head: the interpreter runs a program at a time, and the
# per-token kernels' programs (tokens x heads) set a forward's time.
SMALL = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 16
NUM_BLOCKS = 24  # the scratch block is the one after


def fused_model(path, kernels):
    model = load_model(str(path), torch.float32, DEVICE, 256)
    model.use_kernels(kernels)
    c = model.config
    cache = torch.zeros(model.num_kv_layers, 2, (NUM_BLOCKS + 1) * BLOCK_SIZE, c.num_key_value_heads, c.head_dim,
                        device=DEVICE)
    return model, cache


def step_lists(q_lens, ctx_lens, tables):
    """A step as the runner builds it: ids, positions, and the last row of each sequence to sample."""
    gen = torch.Generator().manual_seed(sum(q_lens))
    ids = torch.randint(0, 300, (sum(q_lens),), generator=gen).tolist()
    positions = [p for q, c in zip(q_lens, ctx_lens) for p in range(c - q, c)]
    ends = [sum(q_lens[:i + 1]) - 1 for i in range(len(q_lens))]
    return ids, positions, ends


@torch.inference_mode()
def test_mixed_step_on_static_inputs_equals_eager(tmp_path, monkeypatch):
    """Steps of prefill chunks beside decodes, padded to their token bucket (tokens, the flash
    kernel's work items and merges, sequences), give eager's logits and greedy tokens, with the
    static plan cutting contexts into pieces of 16 keys and the eager one not; a smaller step
    after a bigger one reads none of its stale inputs."""
    monkeypatch.setattr(attention, "PREFILL_MIN_PIECE", 16)
    build_qwen3(tmp_path, **SMALL)
    model, cache = fused_model(tmp_path, FusedKernels(tile_timing=False))
    mixed = MixedStepGraphs(model, cache, (16, 32), max_seqs=5, width=8, block_size=BLOCK_SIZE,
                            scratch_block=NUM_BLOCKS, num_warmup=0, split_items=4)
    # (q_len, ctx_len) per sequence: a fresh prompt, a chunk starting mid-block, two decodes, a
    # chunk whose first 16 tokens hit the prefix cache (the first sequence's first block).
    steps = [([(9, 9), (9, 30), (1, 40), (1, 7)], [[0], [2, 3], [4, 5, 6], [7]]),
             ([(3, 19), (1, 41)], [[0, 8], [4, 5, 6]]),
             ([(4, 20), (1, 8), (1, 31), (1, 42), (2, 22)], [[0, 9], [7], [2, 3], [4, 5, 6], [0, 1]])]
    for step, tables in steps:
        q_lens, ctx_lens = [q for q, _ in step], [c for _, c in step]
        ids, positions, sample_at = step_lists(q_lens, ctx_lens, tables)
        meta = AttentionMetadata.build(q_lens, ctx_lens, tables, BLOCK_SIZE, DEVICE, fused=True)
        hidden = model(torch.tensor(ids, device=DEVICE), torch.tensor(positions, device=DEVICE), cache, meta)
        want = model.compute_logits(hidden[sample_at]).float()
        bucket = 16 if len(ids) <= 16 else 32
        mixed.stage(bucket, ids, positions, q_lens, ctx_lens, tables, sample_at)
        assert mixed.merges[3 * 4:].sum() > 0  # some tile's context is in pieces
        greedy = mixed.step(bucket)[:len(sample_at)]
        torch.testing.assert_close(mixed.logits[:len(sample_at)], want, rtol=1e-4, atol=1e-4)
        assert greedy.tolist() == want.argmax(-1).tolist()


@pytest.mark.parametrize("odd", [False, True])
def test_every_static_input_of_a_graph_starts_16_bytes_aligned(tmp_path, odd):
    """Triton compiles a variant per pointer alignment, and an eager step's metadata are aligned
    (attention.pack_int32): a static input at an offset that follows the configuration's sizes
    (buckets, steps' rows, sequences, table width) would make the captured kernels and the eager
    ones two variants, the second compiled on a request. Every view of both graph families'
    input buffers starts 16 bytes aligned, on the device and in the host staging."""
    build_qwen3(tmp_path, **SMALL)
    model, cache = fused_model(tmp_path, FusedKernels(tile_timing=False))
    sizes, shapes, seqs = ((3, 5), ((None, 1), (2, 3)), 5) if odd else ((4, 8), ((None, 1), (3, 4)), 8)
    decode = CUDAGraphs(model, cache, CUDAGraphConfig(sizes, shapes, 0), 61 if odd else 64, BLOCK_SIZE, NUM_BLOCKS)
    mixed = MixedStepGraphs(model, cache, (13, 24) if odd else (16, 32), max_seqs=seqs, width=7 if odd else 8,
                            block_size=BLOCK_SIZE, scratch_block=NUM_BLOCKS, num_warmup=0, split_items=3 if odd else 4)
    for family, count in ((decode, 9), (mixed, 10)):
        for views in (family.staged.views, *family.staged._host):
            flat = [v for view in views for v in (view if isinstance(view, tuple) else (view,))]
            offsets = [torch.as_tensor(v).data_ptr() - torch.as_tensor(flat[0]).data_ptr() for v in flat]
            assert len(flat) == count and all(o % 16 == 0 for o in offsets), offsets
    assert decode.seeds.data_ptr() % 16 == decode.temperature.data_ptr() % 16 == decode.positions.data_ptr() % 16


def test_a_step_that_fails_in_the_dry_pass_leaves_the_others_to_it(tmp_path, monkeypatch):
    """The dry pass before the captures (compile_only queues every step's kernels) meets a bucket
    whose step fails: the engine still starts, that bucket's capture reports it (the GPU test
    test_failing_bucket_falls_back_to_eager), and every other bucket is still passed through."""
    build_qwen3(tmp_path, **SMALL)
    model, cache = fused_model(tmp_path, FusedKernels(tile_timing=False))
    decode = CUDAGraphs(model, cache, CUDAGraphConfig((1, 2, 4, 8), ((None, 1), (2, 3)), 0), 64, BLOCK_SIZE,
                        NUM_BLOCKS)
    mixed = MixedStepGraphs(model, cache, (16, 32, 64), max_seqs=4, width=8, block_size=BLOCK_SIZE,
                            scratch_block=NUM_BLOCKS, num_warmup=0, split_items=4)
    seen = []

    def broken(seen_as):
        def step(self, *key):
            seen.append((seen_as, *key))
            if key[-1] in (4, 32):
                raise RuntimeError("simulated failure")
        return step
    monkeypatch.setattr(CUDAGraphs, "_step", broken("decode"))
    monkeypatch.setattr(MixedStepGraphs, "step", broken("mixed"))
    monkeypatch.setattr(MixedStepGraphs, "mtp_step", lambda self, tokens: seen.append(("mtp", tokens)))
    decode.dry_run()
    mixed.dry_run()
    assert seen == [("decode", None, 1, b) for b in (1, 2, 4, 8)] + [("mixed", 16), ("mixed", 32), ("mixed", 64)]


@torch.inference_mode()
def test_a_capture_made_while_serving_writes_only_the_scratch_block(tmp_path):
    """A served engine captures its mixed-step graphs when idle, after real steps were staged:
    each bucket's capture first stages an empty step, so its runs write the scratch block and
    not the slots of the step staged last, which another sequence's KV may fill by then."""
    build_qwen3(tmp_path, **SMALL)
    model, cache = fused_model(tmp_path, FusedKernels(tile_timing=False))
    mixed = MixedStepGraphs(model, cache, (16, 32), max_seqs=5, width=8, block_size=BLOCK_SIZE,
                            scratch_block=NUM_BLOCKS, num_warmup=0, split_items=4)
    q_lens, ctx_lens, tables = [9, 1], [9, 40], [[0], [4, 5, 6]]
    mixed.stage(16, *step_lists(q_lens, ctx_lens, tables)[:2], q_lens, ctx_lens, tables, [8, 9])
    mixed.step(16)
    live = slice(0, NUM_BLOCKS * BLOCK_SIZE)
    cache[:, :, live] = torch.randn_like(cache[:, :, live])  # the blocks went to other sequences
    before = cache.clone()
    for bucket in mixed.pending:  # what capture() runs before each bucket's warm-ups and capture
        mixed._stage_empty(bucket)
        mixed.step(bucket)
    assert torch.equal(cache[:, :, live], before[:, :, live])


@torch.inference_mode()
def test_start_up_tuning_leaves_no_untuned_shape(tmp_path):
    """After `tune_kernels` and `freeze`, no step brings a skinny-matmul shape that would be timed
    lazily: decode and verify batches of every size (a shape is keyed by its rows' power of two),
    MTP drafts, the vocab projection, the mixed-step buckets that take skinny products (one
    sampled row here: the engine tunes its max_num_seqs rows' count too). The
    engine tunes every power of two up to SKINNY_MAX_ROWS; here 1 (FMA tiles) and 16 (tensor-core
    tiles), the interpreter being slow."""
    assert skinny_row_counts() == [1, 2, 4, 8, 16, 32, 64] and max(skinny_row_counts()) == SKINNY_MAX_ROWS
    path = build_drafting_model(tmp_path, mtp_layers=1)
    kernels = FusedKernels(tile_timing=False)
    model, cache = fused_model(path, kernels)
    untuned = FusedKernels(tile_timing=False)  # the check can fail: a frozen engine, never tuned
    model.use_kernels(untuned)
    untuned.freeze()
    run_rows(model, cache, 1)
    assert untuned.untuned
    model.use_kernels(kernels)
    tune_kernels(model, cache, BLOCK_SIZE, NUM_BLOCKS, prefill=17, row_counts=[1, 16])
    kernels.freeze()
    for rows in (1, 13):
        run_rows(model, cache, rows)
    mixed = MixedStepGraphs(model, cache, token_sizes(16), max_seqs=1, width=4, block_size=BLOCK_SIZE,
                            scratch_block=NUM_BLOCKS, num_warmup=0)
    mixed.stage(16, [1] * 9, list(range(9)), [9], [9], [[0]], [8])
    mixed.step(16)
    assert kernels.untuned == set() and kernels.chosen


@torch.inference_mode()
def test_start_up_tuning_of_a_model_without_mtp_layers(tmp_path):
    """Every engine on a GPU tunes at start-up, most of them for models with no MTP layer: no
    draft head to tune there (a draft-head dry run once made every such engine fail to start)."""
    build_qwen3(tmp_path, **SMALL)
    model, cache = fused_model(tmp_path, FusedKernels(tile_timing=False))
    assert not model.mtp
    tune_kernels(model, cache, BLOCK_SIZE, NUM_BLOCKS, prefill=5, row_counts=[1])


def run_rows(model, cache, rows):
    """A decode step of `rows` sequences, its vocab projection and its MTP draft."""
    meta = AttentionMetadata.build([1] * rows, [2] * rows, [[NUM_BLOCKS]] * rows, BLOCK_SIZE, DEVICE, True)
    ids = torch.ones(rows, dtype=torch.long, device=DEVICE)
    hidden = model(ids, ids, cache, meta)
    model.compute_logits(hidden)
    model.mtp_forward(0, ids, ids, hidden, cache, meta)


def test_token_buckets_and_modes(tmp_path):
    """Mixed-step buckets: powers of two to 512, then every 512, the budget, capped at 16384;
    FULL_DECODE_ONLY captures none; speculation the same buckets."""
    assert token_sizes(512) == [16, 32, 64, 128, 256, 512]
    assert token_sizes(100) == [16, 32, 64, 100]
    assert token_sizes(2048) == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    assert token_sizes(8704)[-3:] == [7680, 8192, 8704] and token_sizes(40000)[-1] == 16384
    build_qwen3(tmp_path / "plain")
    args = dict(model=str(tmp_path / "plain"), max_num_batched_tokens=256)
    assert EngineArgs(**args).resolve("cuda").cuda_graphs.token_sizes == (16, 32, 64, 128, 256)
    assert EngineArgs(**args, cudagraph_mode="full_decode_only").resolve("cuda").cuda_graphs.token_sizes == ()
    with pytest.raises(ValueError, match="cudagraph_mode"):
        EngineArgs(**args, cudagraph_mode="piecewise").resolve("cuda")
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    drafting = build_drafting_model(tmp_path / "mtp", mtp_layers=1)
    drafting_args = dict(model=drafting, speculative_config=spec, max_num_batched_tokens=256)
    assert EngineArgs(**drafting_args).resolve("cuda").cuda_graphs.token_sizes == (16, 32, 64, 128, 256)


class _Replayed:
    """Torch's CUDAGraph as a CPU stand-in: replay() runs the captured work again over the static
    inputs, which is what a replay does."""

    def __init__(self, work):
        self.replay = work


@torch.inference_mode()
def test_drafting_prefill_replays_its_mixed_step_graph(tmp_path):
    """With MTP drafting, a prefill step replays its mixed-step graph, which keeps every row's
    hidden state, then, once its tokens are sampled, the graph of its MTP pass, which reads them
    and fills the MTP KV cache of the prompt: that cache is the eager prefill's, so are the first
    drafts (proposed by the step after, attending to it; random MTP heads), and the greedy tokens
    are the plain engine's."""
    from jetserve.engine import LLM, SamplingParams

    path = build_drafting_model(tmp_path, mtp_layers=1, agree=False)
    common = dict(max_model_len=64, max_num_batched_tokens=32, block_size=BLOCK_SIZE, max_num_seqs=2)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    prompts = [{"prompt_token_ids": [(5 * i + 3 * j) % 60 + 2 for j in range(n)]} for i, n in enumerate((5, 9))]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), **common).generate(prompts, greedy, use_tqdm=False)]

    def run(llm):
        """The first drafts (proposed by the step after the prefill) and the greedy tokens."""
        engine, got = llm.engine, {}
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, greedy)
        drafts = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            running = engine.scheduler.running
            if drafts is None and running and all(seq.spec_token_ids for seq in running):
                drafts = [list(seq.spec_token_ids) for seq in running]
        return drafts, [got[str(i)] for i in range(len(prompts))]

    eager = LLM(str(path), speculative_config=spec, **common)
    eager.engine.runner.model.use_kernels(FusedKernels(tile_timing=False))
    llm = LLM(str(path), speculative_config=spec, **common)
    runner = llm.engine.runner
    runner.model.use_kernels(FusedKernels(tile_timing=False))
    mixed = MixedStepGraphs(runner.model, runner.kv_cache, (16,), max_seqs=2, width=-(-(64 + 3) // BLOCK_SIZE),
                            block_size=BLOCK_SIZE, scratch_block=runner.num_blocks, num_warmup=0, mtp_pass=True)
    replays = []
    for size in mixed.sizes:
        mixed.graphs[size] = _Replayed(lambda size=size: mixed.greedy.__setitem__(size, mixed.step(size)))
        mixed.mtp_graphs[size] = _Replayed(lambda size=size: replays.append(("mtp", size)) or mixed.mtp_step(size))
    replay = mixed.replay
    mixed.replay = lambda bucket, n: replays.append(bucket) or replay(bucket, n)
    runner.mixed = mixed
    (want_drafts, _), (drafts, got) = run(eager), run(llm)
    assert replays == [16, ("mtp", 16)] and got == want and drafts == want_drafts and all(map(len, drafts)), \
        (replays, drafts, want_drafts)
    # The MTP layer's KV cache (the last layer's), prompt positions included, as the eager prefill
    # wrote it; the scratch block past the pool takes the graph's padded rows.
    used = runner.num_blocks * BLOCK_SIZE
    torch.testing.assert_close(runner.kv_cache[-1, :, :used], eager.engine.runner.kv_cache[-1, :, :used],
                               rtol=1e-4, atol=1e-5)
