"""Train the bundled demo model: `python -m jetserve.engine.offline.demo --out DIR`.

A small Qwen3 (one MTP layer) trained on the CPython standard library sources of the machine
it runs on, so a new user gets real, streaming, drafted text with no download. Steps:
byte-level BPE tokenizer (`tokenizers`) → base model (next-token cross-entropy) → MTP head by
`mtp fit` (distillation from the base) → merged checkpoint + model card. Everything is seeded;
the base trains for `--epochs` passes (the stdlib is a few million tokens: more memorizes).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from jetserve.engine.config import ModelConfig, resolve_device
from jetserve.engine.offline.export import model_tensors
from jetserve.engine.model.qwen3 import Qwen3ForCausalLM
from jetserve.engine.offline.mtp_fit import fit

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
SKIP = {"site-packages", "dist-packages", "__pycache__"}


def config_dict(vocab_size: int, hidden: int, layers: int, intermediate: int, max_positions: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab_size,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": max_positions,
        "tie_word_embeddings": True, "attention_bias": False, "dtype": "bfloat16",
        "bos_token_id": None, "eos_token_id": 0,
    }


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's own .py files (no installed packages), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py") if not SKIP & set(f.relative_to(root).parts))
    return root, files


def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "unk_token": None, "model_max_length": 2048, "chat_template": CHATML,
        "added_tokens_decoder": {str(tok.token_to_id(s)): {"content": s, "special": True} for s in SPECIAL},
    }, indent=2) + "\n")
    eos = [tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_end|>")]
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos, "pad_token_id": eos[0], "temperature": 0.7, "top_p": 0.95}, indent=2) + "\n")
    return tok


def encode(tok, texts: list[str]) -> torch.Tensor:
    eos = tok.token_to_id("<|endoftext|>")
    ids = []
    for e in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(e.ids + [eos])
    return torch.tensor(ids, dtype=torch.long)


def init_weights(model: Qwen3ForCausalLM) -> None:
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.data /= math.sqrt(2 * len(model.layers))  # residual branches (GPT-2's scaling)


def lm_loss(model: Qwen3ForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    ids, labels = batch[:, :-1], batch[:, 1:]
    positions = torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0])
    hidden = model(ids, positions, [None] * model.num_kv_layers, None)
    logits = model.compute_logits(hidden).float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, seq_len: int, batch_size: int, device) -> float:
    n = (len(tokens) - 1) // (seq_len + 1)
    windows = tokens[:n * (seq_len + 1)].view(n, seq_len + 1)[:batch_size * 8]
    with torch.enable_grad():  # the plain torch path; no parameter wants a gradient here
        losses = [lm_loss(model, windows[i:i + batch_size].to(device)).item()
                  for i in range(0, len(windows), batch_size)]
    return sum(losses) / len(losses)


def train_base(cfg: ModelConfig, tokens: torch.Tensor, *, steps: int, batch_size: int,
               seq_len: int, lr: float, seed: int, device) -> tuple[Qwen3ForCausalLM, dict]:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg, seq_len + 8).to(device)
    init_weights(model)
    model.train()
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    rng = random.Random(seed)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step(s: int, total: int) -> float:
        warmup = max(1, total // 50)
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1, (s + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * s / total)))
        starts = [rng.randrange(len(tokens) - seq_len - 1) for _ in range(batch_size)]
        batch = torch.stack([tokens[i:i + seq_len + 1] for i in starts]).to(device)
        with autocast:
            loss = lm_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    bar = tqdm(range(steps), desc="base", unit="step")
    loss = float("nan")
    for s in bar:
        loss = step(s, steps)
        if s % 50 == 0:
            bar.set_postfix(loss=f"{loss:.3f}")
    model.eval()
    return model, {"steps": steps, "final_train_loss": round(loss, 4)}


def save_base(model: Qwen3ForCausalLM, config: dict, out: Path) -> None:
    from safetensors.torch import save_file

    tensors = {n: t.to("cpu", torch.bfloat16).contiguous() for n, t in model_tensors(model).items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jetserve.engine.offline.demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for the finished checkpoint")
    p.add_argument("--epochs", type=float, default=4,
                   help="base training passes over the corpus (more memorizes: the corpus is small)")
    p.add_argument("--mtp-steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files (quick tries)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = torch.device(resolve_device(args.device))
    torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)

    root, files = stdlib_files()
    files = files[:args.max_files]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    held_out = set(range(0, len(files), 50))  # every 50th file is validation
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(tmp) / "base"
        base_dir.mkdir()
        tok = train_tokenizer(texts, args.vocab_size, base_dir)
        train = encode(tok, [t for i, t in enumerate(texts) if i not in held_out])
        valid = encode(tok, [t for i, t in enumerate(texts) if i in held_out])
        config = config_dict(tok.get_vocab_size(), args.hidden, args.layers, args.intermediate, 2048)
        cfg = ModelConfig.from_dict(config)
        t0 = time.time()
        steps = max(1, int(args.epochs * len(train) / (args.batch_size * args.seq_len)))
        model, base = train_base(cfg, train, steps=steps, batch_size=args.batch_size, seq_len=args.seq_len,
                                 lr=args.lr, seed=args.seed, device=device)
        base["valid_loss"] = round(evaluate(model, valid, args.seq_len, args.batch_size, device), 4)
        base["seconds"] = round(time.time() - t0)
        save_base(model, config, base_dir)
        del model
        mtp = fit(base_dir, None, out, steps=args.mtp_steps, batch_size=args.batch_size, seq_len=args.seq_len,
                  depth=3, lr=1e-3, device=args.device, seed=args.seed, force=True, tokens=train)
    report = {
        "python": sysconfig.get_python_version(), "stdlib": str(root), "files": len(files),
        "train_tokens": len(train), "valid_tokens": len(valid), "vocab_size": tok.get_vocab_size(),
        "base": base, "mtp": {k: mtp[k] for k in ("steps", "final_kl", "final_agreement", "depth")},
        "size_bytes": sum(f.stat().st_size for f in out.iterdir()), "seed": args.seed,
        "command": "python -m jetserve.engine.offline.demo " + " ".join(argv if argv is not None else _argv()),
        "config": {k: config[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")},
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "README.md").write_text(model_card(report))
    print(json.dumps(report, indent=2))
    return 0


def _argv() -> list[str]:
    import sys

    return sys.argv[1:]


def model_card(r: dict) -> str:
    c, b, m = r["config"], r["base"], r["mtp"]
    agree = ", ".join(f"{a:.2f}" for a in m["final_agreement"])
    return f"""# jetserve demo model

A small Qwen3-architecture model with one MTP (multi-token prediction) layer, bundled with
jetserve so that `jetserve serve` shows real, streaming, drafted text with no download. It
writes Python: it has read nothing but the CPython standard library. It is a demo, not an
assistant — a chat request gets a Python-looking continuation.

| | |
|---|---|
| architecture | Qwen3ForCausalLM + 1 MTP layer (Qwen3-Next `mtp.*` naming), tied embeddings |
| shape | hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, 4 heads of 64 (2 KV heads), intermediate {c['intermediate_size']}, vocab {c['vocab_size']} |
| weights | bfloat16 safetensors, {r['size_bytes'] / 1e6:.1f} MB for the whole directory |
| corpus | CPython {r['python']} standard library `*.py` ({r['files']} files from `{r['stdlib']}`, no site-packages); every 50th file held out |
| tokenizer | byte-level BPE trained with `tokenizers` on the same files, {r['vocab_size']} tokens; `<|endoftext|>` between files; ChatML template |
| tokens | {r['train_tokens']:,} train, {r['valid_tokens']:,} held out |
| base training | {b['steps']} steps (AdamW, cosine, bf16 autocast), {b['seconds']} s; train loss {b['final_train_loss']}, held-out loss {b['valid_loss']} |
| MTP head | `mtp fit`: {m['steps']} steps of KL distillation from the frozen base (chain depth {m['depth']}); final KL {m['final_kl']:.3f}, top-1 agreement by depth {agree} |
| seed | {r['seed']} |

Reproduce (one GPU, a few minutes; the corpus is whatever Python runs it, so expect small
differences across Python versions):

```
{r['command']}
```

Use: `jetserve serve` (no `--model`) or
`LLM(model=<this dir>, speculative_config={{"method": "mtp", "num_speculative_tokens": 3}})`.
"""


if __name__ == "__main__":
    raise SystemExit(main())
