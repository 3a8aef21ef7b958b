"""The engine against transformers: greedy tokens and prefill logits, batched and chunked."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from jetserve.engine import LLM, SamplingParams
from jetserve.engine.model.attention import AttentionMetadata
from jetserve.engine.model.loader import load_model

from tests.engine.builders import build_qwen3, hf_greedy

PROMPTS = [[5, 17, 2, 99, 31, 8, 64], [200, 3], list(range(40, 63)), [7] * 11]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

SHAPES = {
    "tied-gqa-odd-head-dim": {},
    "untied-mha": dict(tie_word_embeddings=False, num_key_value_heads=4, head_dim=16),
    "untied-gqa-wide-heads": dict(tie_word_embeddings=False, num_attention_heads=8, num_key_value_heads=2,
                                  head_dim=32, num_hidden_layers=3),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = build_qwen3(path, seed=len(request.param), **SHAPES[request.param])
    reference = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    return path, model, reference


def generate(path, **kwargs):
    llm = LLM(str(path), max_num_seqs=8, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.blocks.num_used == 0
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("budget", range(1, 8))
def test_greedy_matches_transformers_with_chunked_prefill(checkpoint, budget):
    path, _, reference = checkpoint
    assert generate(path, max_num_batched_tokens=budget, block_size=4) == reference


def test_greedy_matches_transformers_without_chunking(checkpoint):
    path, _, reference = checkpoint
    assert generate(path, enable_chunked_prefill=False) == reference


def test_prefill_logits_match_transformers(checkpoint):
    """Logits of every prompt position, computed in two chunks through the paged cache."""
    path, hf_model, _ = checkpoint
    prompt = PROMPTS[2]
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    model = load_model(str(path), torch.float32, torch.device("cpu"), 256)
    cfg = model.config
    cache = torch.zeros(model.num_kv_layers, 2, 64, cfg.num_key_value_heads, cfg.head_dim)
    table, split = list(range(8)), 9
    rows = []
    for start, end in [(0, split), (split, len(prompt))]:
        meta = AttentionMetadata.build([end - start], [end], [table], 8, torch.device("cpu"))
        with torch.no_grad():
            hidden = model(torch.tensor(prompt[start:end]), torch.arange(start, end), cache, meta)
            rows.append(model.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(rows), expected, rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint_and_dtype_override(checkpoint, tmp_path):
    """Split the weights over two files with an index; bf16 on request, same greedy tokens in fp32."""
    path, _, reference = checkpoint
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate([names[:half], names[half:]]):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, tmp_path / file)
        weight_map.update({n: file for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    assert generate(tmp_path) == reference
    llm = LLM(str(tmp_path), dtype="bfloat16", max_num_seqs=2)
    assert llm.engine.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == NEW_TOKENS
