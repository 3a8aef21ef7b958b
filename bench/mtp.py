"""`jetserve bench mtp`: MTP drafting on the demo model — acceptance per position, mean accepted
length and decode tok/s for k = 1..4, greedy and sampled, against no drafting.

Single-stream decode (one request at a time), the case speculation is for: each step reads
all weights for one token unless drafts let it emit more. Acceptance is measured with the
adaptive draft length off, so every step drafts exactly k.
"""

from __future__ import annotations

import time
from pathlib import Path

import jetserve
from jetserve.bench.common import environment, write_results

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    \"\"\"A last-in, first-out container.\"\"\"\n\n    def __init__(self):\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import re\n\n_WORD = re.compile(",
    "    def __repr__(self):\n        return ",
    "try:\n    import _thread\nexcept ImportError:\n",
    "def read_config(path, encoding='utf-8'):\n    with open(path",
    "class TestParser(unittest.TestCase):\n\n    def test_",
]


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=str(Path(jetserve.__file__).parent / "models" / "demo"),
                        help="checkpoint with MTP heads (default: the bundled demo model)")
    parser.add_argument("--ks", default="1,2,3,4", help="draft lengths to measure")
    parser.add_argument("--temperatures", default="0,0.7", help="0 is greedy")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens generated per prompt")
    parser.add_argument("--repeat", type=int, default=1, help="times through the prompt list")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")


def _measure(llm, temperature: float, args) -> dict:
    from jetserve.engine import SamplingParams

    engine = llm.engine
    before = engine.stats()
    tokens, seconds = 0, 0.0
    for i, prompt in enumerate(PROMPTS * args.repeat):
        params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=i)
        t = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds += time.perf_counter() - t
        tokens += len(out.outputs[0].token_ids)
    after = engine.stats()
    drafts = after.num_drafts - before.num_drafts
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    per_pos = [a - b for a, b in zip(after.accepted_per_position,
                                      before.accepted_per_position + [0] * len(after.accepted_per_position))]
    return {
        "tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1),
        "drafts": drafts, "draft_tokens": after.num_draft_tokens - before.num_draft_tokens, "accepted": accepted,
        "acceptance_per_position": [round(a / drafts, 4) for a in per_pos] if drafts else [],
        "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
        "sample": out.outputs[0].text[:300],
    }


def run(args) -> dict:
    import torch

    from jetserve.engine import LLM, SamplingParams

    ks = [int(k) for k in args.ks.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    common = {"device": args.device, "dtype": args.dtype, "enforce_eager": args.enforce_eager, "max_num_seqs": 4,
              "max_model_len": 1024}
    runs = []
    for k in [0] + ks:
        spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False} if k else None
        llm = LLM(args.model, speculative_config=spec, **common)
        for temperature in temperatures:  # warm-up: kernels compile and tune for every shape met below
            llm.generate([PROMPTS[0]], SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                                      ignore_eos=True), use_tqdm=False)
        for temperature in temperatures:
            runs.append({"k": k, "temperature": temperature, **_measure(llm, temperature, args)})
            print(f"k={k} T={temperature}: {runs[-1]['tok_s']} tok/s, mean accepted length "
                  f"{runs[-1]['mean_accepted_length']}, per position {runs[-1]['acceptance_per_position']}",
                  flush=True)
        device = llm.engine.runner.device
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = {r["temperature"]: r["tok_s"] for r in runs if r["k"] == 0}
    for r in runs:
        r["speedup"] = round(r["tok_s"] / base[r["temperature"]], 3)
    result = {"benchmark": "mtp", "model": args.model, "max_tokens": args.max_tokens, "prompts": len(PROMPTS),
              "repeat": args.repeat, "enforce_eager": args.enforce_eager, "env": environment(device), "runs": runs}
    if args.out:
        write_results(args.out, result, {"mtp": _figure(runs, ks, temperatures)})
    else:
        import json

        print(json.dumps(result, indent=2))
    return result


def _figure(runs, ks, temperatures):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, speed) = plt.subplots(1, 2, figsize=(11, 4))
    for temperature, style in zip(temperatures, ["-", "--", ":"]):
        for r in runs:
            if r["temperature"] == temperature and r["k"]:
                acc.plot(range(1, r["k"] + 1), r["acceptance_per_position"], style, marker="o",
                         label=f"k={r['k']} T={temperature:g} (mean len {r['mean_accepted_length']:.2f})")
    acc.set(xlabel="draft position", ylabel="fraction of drafts accepted up to here", ylim=(0, 1.02),
            title="MTP acceptance by position")
    acc.set_xticks(range(1, max(ks) + 1))
    acc.legend(fontsize=7)
    width = 0.8 / len(temperatures)
    for i, temperature in enumerate(temperatures):
        rs = [r for r in runs if r["temperature"] == temperature]
        speed.bar([r["k"] + (i - (len(temperatures) - 1) / 2) * width for r in rs], [r["tok_s"] for r in rs], width,
                  label=f"T={temperature:g}")
    speed.set(xlabel="num_speculative_tokens (0 = no drafting)", ylabel="decode tok/s (one stream)",
              title="Decode speed")
    speed.set_xticks([0] + ks)
    speed.legend()
    fig.tight_layout()
    return fig
