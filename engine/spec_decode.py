"""MTP speculative decoding: draft with the checkpoint's MTP layers, verify losslessly.

A step with speculation, per decoding sequence whose last token is x_t and drafts d_1..d_k:

1. The main model computes x_t, d_1..d_k in one forward (batched with everything else).
2. `verify` accepts a prefix of the drafts and emits one more token (the correction, or the
   bonus when all k were accepted): greedy requests by exact match with the argmax, sampled
   ones by rejection sampling, so the output is exactly the model's distribution.
3. The MTP pass runs MTP layer 0 over the same rows, fed the main hidden state at position p
   and the token at p+1: the tokens now known, i.e. the prompt, accepted drafts and the new
   token. Prefill chunks go through it too, so the MTP layer's KV cache holds the whole context
   (vLLM's "shifted by one"). Rows past the last accepted token are garbage and get rewritten
   next step, like the main model's rejected entries (rollback = `num_computed_tokens`).
4. Drafting chains from the last accepted row: step j runs MTP layer j % n on the previous
   draft and the previous MTP hidden state, one token per sequence. Drafts are argmax (one-hot),
   which is what makes the acceptance rule "accept x with probability p(x)" exact.

`DraftLength` picks k each step from a rolling window of outcomes (adaptive draft length).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from jetserve.engine.config import SpeculativeConfig
from jetserve.engine.model.attention import AttentionMetadata
from jetserve.engine.sampler import exponential_noise, processed_probs
from jetserve.engine.sampling_params import SamplingParams
from jetserve.engine.sequence import Sequence


def verify(logits: torch.Tensor, drafts: list[list[int]], params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[list[int]]:
    """Accept a prefix of each sequence's one-hot drafts and add one token; lossless.

    logits: [sum(len(d) + 1), V] fp32, the rows of each sequence in order (its drafts' positions,
    then the bonus position). Greedy: accept while the draft is the argmax, then emit the argmax.
    Sampled: accept draft x with probability p(x); at the first rejection draw from p with x
    removed and renormalized; when all are accepted draw the bonus from p.
    """
    counts = [len(d) + 1 for d in drafts]
    owner = [i for i, c in enumerate(counts) for _ in range(c)]
    checked = [x for d in drafts for x in d + [-1]]  # the draft each row checks; -1: the bonus row
    target = logits.argmax(dim=-1)
    accept = torch.zeros_like(target, dtype=torch.bool)  # greedy rows accept by matching `target`
    rows = [r for r, i in enumerate(owner) if not params[i].greedy]
    if rows:
        gens = [generators[owner[r]] for r in rows]
        probs = processed_probs(logits[rows], [params[owner[r]] for r in rows])
        draft = torch.tensor([checked[r] for r in rows], device=logits.device)
        has_draft = (draft >= 0)[:, None]
        draft = draft.clamp(min=0)[:, None]
        coin = torch.exp(-exponential_noise(probs[:, :1], gens))  # exp(-E) is U(0, 1)
        accept[rows] = (has_draft & (coin < probs.gather(1, draft)))[:, 0]
        residual = torch.where(has_draft, probs.scatter(1, draft, 0.0), probs)
        # argmax p/E samples p without normalizing; the residual never holds the rejected draft.
        target[rows] = (residual / exponential_noise(residual, gens)).argmax(dim=-1)
    target, accept = target.tolist(), accept.tolist()
    out, row = [], 0
    for draft_ids, count in zip(drafts, counts):
        n = 0
        while n < len(draft_ids) and (draft_ids[n] == target[row + n] or accept[row + n]):
            n += 1
        out.append(draft_ids[:n] + [target[row + n]])
        row += count
    return out


Verify = Callable[[torch.Tensor, list[list[int]], list[SamplingParams], list[torch.Generator | None]],
                  list[list[int]]]


class MTPProposer:
    """The MTP pass and the drafting chain of one step (steps 3 and 4 above)."""

    def __init__(self, max_model_len: int, block_size: int, device: torch.device, fused: bool,
                 verify: Verify = verify):
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.fused = fused  # the model runs the Triton kernels: uniform steps take the paged kernel
        self.verify = verify  # the acceptance rule; a parameter so a test can prove a wrong one is caught

    def num_drafts(self, seq: Sequence, emitted: list[int], k: int) -> int:
        """Drafts worth making: none past max_model_len or past the request's max_tokens."""
        left = self.max_model_len - seq.num_tokens - len(emitted)
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens - len(emitted) - 1)
        return max(0, min(k, left))

    def propose(self, draft_forward, compute_logits, seqs: list[Sequence], num_tokens: list[int],
                hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                emitted: list[list[int] | None], k: int) -> list[list[int]]:
        """Run the MTP pass over this step's rows, then chain drafts; returns drafts per sequence."""
        shifted, last_rows, row = [], [], 0
        for seq, n, new in zip(seqs, num_tokens, emitted):
            start = seq.num_computed_tokens
            known = seq.token_ids[start + 1:start + n + 1] + (new or [])
            shifted.extend(known[:n] + [0] * (n - len(known)))
            # The last verified row: its successor is the token just emitted.
            last_rows.append(row + n - 1 - len(seq.spec_token_ids) + len(new) - 1 if new else -1)
            row += n
        mtp_hidden = draft_forward(0, torch.tensor(shifted, device=self.device), positions, hidden, meta)
        counts = [self.num_drafts(s, new, k) if new else 0 for s, new in zip(seqs, emitted)]
        drafts: list[list[int]] = [[] for _ in seqs]
        active = [i for i, c in enumerate(counts) if c > 0]
        if not active:
            return drafts
        h = mtp_hidden[[last_rows[i] for i in active]]
        # Position of the last verified token; draft j (1-based) is guessed at position last + j + 1.
        last = [seqs[i].num_tokens + len(emitted[i]) - 2 for i in active]
        for step in range(max(counts[i] for i in active)):
            if step:
                ids = torch.tensor([drafts[i][-1] for i in active], device=self.device)
                pos = [p + step for p in last]
                step_meta = AttentionMetadata.build([1] * len(active), [p + 1 for p in pos],
                                                    [seqs[i].block_table for i in active], self.block_size,
                                                    self.device, self.fused)
                h = draft_forward(step, ids, torch.tensor(pos, device=self.device), h, step_meta)
            tokens = compute_logits(h).argmax(dim=-1).tolist()
            for i, t in zip(active, tokens):
                drafts[i].append(t)
            keep = [m for m, i in enumerate(active) if counts[i] > step + 1]
            active, last, h = [active[m] for m in keep], [last[m] for m in keep], h[keep]
            if not active:
                break
        return drafts


class DraftLength:
    """How many tokens to draft next step (adaptive draft length).

    Drafting position j pays when P(accepted length >= j) is high enough: it costs one MTP
    layer step and one verified row, and gains that probability in tokens. From a rolling
    window of verifications, k is the longest run of positions whose estimate reaches
    `acceptance_threshold`. Position k+1 is only seen when it is drafted, so every
    `probe_interval`-th step drafts k+1: at k = 0 that is one draft token on one step in N,
    which costs little and keeps measuring the heads, so k comes back when they recover. The
    probes see full context because the MTP pass keeps the MTP KV cache filled even at k = 0
    (one extra layer per step); a probe over a stale cache would underestimate acceptance and
    k would never come back.
    """

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.k_max = self.k = config.num_speculative_tokens
        self.window: deque[tuple[int, int]] = deque()
        size = config.num_speculative_tokens + 2
        self.drafted_ge = [0] * size  # drafted_ge[j]: verifications in the window that drafted >= j
        self.accepted_ge = [0] * size  # ... of which >= j were accepted
        self.steps = 0

    def next(self) -> int:
        self.steps += 1
        probe = self.config.adaptive and self.k < self.k_max and self.steps % self.config.probe_interval == 0
        return self.k + probe

    def set_max(self, k: int) -> None:
        """Live control: the most tokens to draft; 0 turns drafting off (no probes either)."""
        self.k_max = self.k = k
        size = max(len(self.drafted_ge), k + 2)
        self.drafted_ge += [0] * (size - len(self.drafted_ge))
        self.accepted_ge += [0] * (size - len(self.accepted_ge))

    def record(self, drafted: int, accepted: int) -> None:
        self._count(drafted, accepted, +1)
        self.window.append((drafted, accepted))
        if len(self.window) > self.config.acceptance_window:
            self._count(*self.window.popleft(), -1)

    def _count(self, drafted: int, accepted: int, sign: int) -> None:
        for j in range(1, min(drafted, len(self.drafted_ge) - 1) + 1):
            self.drafted_ge[j] += sign
            self.accepted_ge[j] += sign * (accepted >= j)

    def update(self) -> None:
        """Re-choose k from the window (once a step, after its verifications were recorded)."""
        if not self.config.adaptive:
            return
        k = 0
        for j in range(1, self.k_max + 1):
            seen = self.drafted_ge[j]
            if seen < self.config.min_samples:
                if j > self.k:  # no evidence either way: keep what we have
                    break
            elif self.accepted_ge[j] < self.config.acceptance_threshold * seen:
                break
            k = j
        self.k = k


@dataclass
class SpecCounters:
    """Totals since start, for EngineStats (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # verifications with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j+1

    def record(self, drafted: int, accepted: int) -> None:
        self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for j in range(accepted):
            self.accepted_per_position[j] += 1
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafted step emits on average: accepted drafts plus the one verified token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
