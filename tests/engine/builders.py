"""Tiny random Qwen3 checkpoints built with transformers offline: the reference for the engine."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import Qwen3Config, Qwen3ForCausalLM

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "你好，世界！今天天气很好。我们一起学习机器学习。",
    "日本語のテキストも少し。東京は大きい都市です。",
    "Emoji: 🙂🚀🔥👍🏽 and 🇯🇵 flags 😀 mixed with text.",
    "def main():\n    return 42  # code too\n",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def build_qwen3(path, seed=0, **overrides):
    """Save a random Qwen3 checkpoint to `path` and return the transformers model."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**{**TINY, **overrides})).eval()
    # Random init leaves the norms at 1.0; perturb them so a mixed-up norm cannot pass.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def add_tokenizer(path, vocab_size=TINY["vocab_size"]):
    """Train a byte-level BPE with `tokenizers` and save it beside a checkpoint (ChatML template)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": CHATML}))
    eos = tok.token_to_id("<|im_end|>")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    return tok


def hf_greedy(model, prompt, max_new_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


DRAFT_HIDDEN = 32


def build_drafting_model(path: Path, vocab=64, agree=True, context=3.0, sharpness=4.0, mtp_layers=1, seed=0,
                         hidden=DRAFT_HIDDEN) -> str:
    """A random Qwen3 reshaped so drafting has something to agree with: big embeddings and small
    attention/MLP outputs make it mostly a bigram model (`context` sets how much the rest of the
    context moves it); "agreeing" MTP heads pass the embedding of token t+1 straight through
    (fc = [I | 0], zeroed block outputs), so they predict the base's guess for x_{t+2}."""
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                         max_position_embeddings=256)
    Qwen3ForCausalLM(config).save_pretrained(path)
    state = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    state["model.embed_tokens.weight"] = torch.randn(vocab, hidden, generator=gen)
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name] = torch.randn(state[name].shape, generator=gen) * context / 8
    state["lm_head.weight"] = torch.randn(vocab, hidden, generator=gen) * sharpness / hidden ** 0.5
    if mtp_layers:
        state.update(_agreeing_or_random_heads(state, agree, mtp_layers, gen, hidden))
        cfg = json.loads((path / "config.json").read_text())
        cfg["mtp_num_hidden_layers"] = mtp_layers
        (path / "config.json").write_text(json.dumps(cfg))
    save_file(state, path / "model.safetensors")
    return str(path)


def _agreeing_or_random_heads(state, agree, layers, gen, hidden):
    block = {k[len("model.layers.0."):]: v for k, v in state.items() if k.startswith("model.layers.0.")}
    heads = {}
    for j in range(layers):
        for name, value in block.items():
            if name.endswith("norm.weight"):
                w = torch.ones_like(value)
            elif agree and name.endswith(("o_proj.weight", "down_proj.weight")):
                w = torch.zeros_like(value)
            else:
                w = torch.randn(value.shape, generator=gen) * 0.1
            heads[f"mtp.layers.{j}.{name}"] = w
    eye = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
    heads["mtp.fc.weight"] = eye if agree else torch.randn(hidden, 2 * hidden, generator=gen)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        heads[f"mtp.{name}.weight"] = torch.ones(hidden)
    return heads
