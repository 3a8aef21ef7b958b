"""`jetserve mtp fit`: train MTP heads for a checkpoint that has none, by distillation.

The base stays frozen. An MTP layer at position t sees the base's final hidden state h_t and
token x_{t+1}, and is trained to match the base's own distribution at t+1 (its prediction of
x_{t+2}) with KL(p_base || q_head), not cross-entropy on the data's x_{t+2} nor on the base's
argmax: drafting pays only when the head agrees with the model it drafts for, the full
distribution carries far more signal per token than one label, and with sampling the chance
that a one-hot draft x is accepted is p_base(x), exactly what matching p_base maximizes.

`depth` > 1 also trains the chain the engine runs when k exceeds the MTP layers: step d feeds
step d-1's output state and token x_{t+d+1}, and must match the base at t+d+1. (Its attention
sees the chain's own earlier rows, where the engine's cache holds step 0's: close enough to
lift acceptance at positions 2-3, at the cost of one more layer pass per depth.)

The heads are written in Qwen3-Next naming and merged with the base by `mtp_checkpoint.merge`.
"""

from __future__ import annotations

import math
import random
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from jetserve.engine.config import resolve_device
from jetserve.engine.model.checkpoint import CheckpointError
from jetserve.engine.offline.export import mtp_tensors
from jetserve.engine.model.loader import load_model, torch_dtype
from jetserve.engine.model.qwen3 import MTPLayer, Qwen3ForCausalLM
from jetserve.engine.offline.mtp_checkpoint import merge
from jetserve.engine.tokenizer import Tokenizer


def tokenize_files(model_dir, files) -> torch.Tensor:
    """Every file's tokens, each followed by an EOS, as one stream."""
    tokenizer = Tokenizer.from_pretrained(model_dir)
    sep = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]
    ids = []
    for encoding in tokenizer.backend.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids + ([sep] if sep is not None else []))
    return torch.tensor(ids, dtype=torch.long)


def new_heads(model: Qwen3ForCausalLM, num_layers: int) -> nn.ModuleList:
    """MTP layers that start from the base's last decoder block; fc starts as (e + h) / 2.
    Qwen3-Next naming stores one fc and norm set, so the layers share them."""
    cfg = replace(model.config, num_mtp_layers=num_layers)
    last = model.layers[-1]
    heads = nn.ModuleList(MTPLayer(cfg) for _ in range(num_layers)).to(last.mlp.down_proj.weight.device)
    hidden = cfg.hidden_size
    with torch.no_grad():
        heads[0].fc.weight.copy_(torch.cat([torch.eye(hidden), torch.eye(hidden)], 1) / 2)
        for layer in heads:
            layer.block.load_state_dict(last.state_dict())
            for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
                setattr(layer, name, getattr(heads[0], name))
            layer.norm.weight.copy_(model.norm.weight)
    return heads.float()


def distill_loss(model: Qwen3ForCausalLM, window: torch.Tensor, depth: int) -> tuple[torch.Tensor, list[float]]:
    """KL to the base at each chain depth over a batch of windows [B, L + depth + 1]; also the
    top-1 agreement of each depth (the greedy acceptance rate it predicts)."""
    length = window.shape[1] - depth - 1
    nothing = [None] * model.num_kv_layers
    # The base is frozen (no parameter wants a gradient), so this builds no graph; it runs with
    # grad mode on to stay on the plain torch path (the fused CUDA kernels have no backward).
    ids = window[:, :length + depth]
    base = model(ids, torch.arange(ids.shape[1], device=ids.device).repeat(ids.shape[0]), nothing, None)
    target = F.log_softmax(model.compute_logits(base).float(), dim=-1)
    hidden, losses, agree = base[:, :length], [], []
    for d in range(depth):
        # Row t: position t+d, fed token x_{t+d+1}; matches the base's distribution at t+d+1.
        ids = window[:, d + 1:length + d + 1]
        positions = torch.arange(d, length + d, device=ids.device).repeat(ids.shape[0])
        hidden = model.mtp_forward(d, ids, positions, hidden, nothing, None)
        log_q = F.log_softmax(model.compute_logits(hidden).float(), dim=-1)
        p = target[:, d + 1:length + d + 1]
        losses.append(F.kl_div(log_q, p, log_target=True, reduction="none").sum(-1).mean())
        agree.append((log_q.argmax(-1) == p.argmax(-1)).float().mean().item())
    return sum(losses) / depth, agree


def train_heads(model: Qwen3ForCausalLM, tokens: torch.Tensor, *, steps: int, batch_size: int, seq_len: int,
                depth: int, lr: float, seed: int, desc: str = "mtp fit") -> dict:
    """Train `model.mtp` on random windows of `tokens` (the rest frozen); returns the metrics."""
    device = model.embed_tokens.weight.device
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for p in model.mtp.parameters()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))))
    rng = random.Random(seed)
    span = seq_len + depth + 1
    if len(tokens) < span + 1:
        raise ValueError(f"data: {len(tokens)} tokens is less than one window of {span}")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    bar = tqdm(range(steps), desc=desc, unit="step")
    loss, agree = float("nan"), []
    for _ in bar:
        starts = [rng.randrange(len(tokens) - span) for _ in range(batch_size)]
        window = torch.stack([tokens[s:s + span] for s in starts]).to(device)
        with autocast:
            value, agree = distill_loss(model, window, depth)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        loss = value.item()
        bar.set_postfix(kl=f"{loss:.3f}", agree="/".join(f"{a:.2f}" for a in agree))
    model.eval()
    return {"steps": steps, "final_kl": loss, "final_agreement": agree}


def fit(model_dir, data_files, out_dir, *, num_layers: int = 1, steps: int = 1000, batch_size: int = 16,
        seq_len: int = 256, depth: int = 2, lr: float = 1e-3, device: str = "auto", seed: int = 0,
        force: bool = False, tokens: torch.Tensor | None = None) -> dict:
    """Train MTP heads for `model_dir` on `data_files` and write base + heads to `out_dir`."""
    if num_layers < 1 or depth < 1 or steps < 1:
        raise ValueError("num_layers, depth and steps must be >= 1")
    torch.manual_seed(seed)
    dev = torch.device(resolve_device(device))
    model = load_model(str(model_dir), torch_dtype("float32") if dev.type == "cpu" else torch.bfloat16, dev,
                       seq_len + depth + 1)
    if len(model.mtp):
        raise CheckpointError(f"{model_dir}: already has MTP heads (fit trains heads for a checkpoint without)")
    if tokens is None:
        if not data_files:
            raise ValueError("data: give at least one text file")
        tokens = tokenize_files(model_dir, data_files)
    model.mtp = new_heads(model, num_layers)
    metrics = train_heads(model, tokens, steps=steps, batch_size=batch_size, seq_len=seq_len, depth=depth,
                          lr=lr, seed=seed)
    from safetensors.torch import save_file

    dtype = torch_dtype(model.config.dtype)  # the heads ship in the checkpoint's own dtype
    with tempfile.TemporaryDirectory() as tmp:
        heads = Path(tmp) / "mtp.safetensors"
        save_file({n: t.to("cpu", dtype).contiguous() for n, t in mtp_tensors(model.mtp).items()}, heads)
        result = merge(model_dir, heads, out_dir, force=force)
    return {**metrics, **result, "tokens": len(tokens), "depth": depth, "num_layers": num_layers}
