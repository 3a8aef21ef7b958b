"""`jetserve bench mtp`: does MTP drafting pay, and what does a speculative step cost?

Two modes:

- a checkpoint with MTP heads (default: the bundled demo model): single-stream decode tok/s
  with no drafting and with k = 1..4 drafts, greedy and sampled, on held-out prompts
  (`mtp_prompts.json`: the opening lines of functions from the pip packages `packaging` and
  `click`, not part of the CPython standard library the demo model was trained on), with
  acceptance per position and mean accepted length; how often greedy with drafting diverges
  from greedy without, and where; and the step times below.
- `--shape qwen3-0.6b|qwen3-4b`: random weights of that shape with one random MTP layer. Only
  step times mean anything there.

Step times: the median time of a decode step (every sequence decoding) at batch 1 and 8, with
no drafting and for each k (k = 0: a decode with the MTP pass), their ratio to the plain
decode step, and the break-even acceptance: the per-position acceptance a at which a step
that drafts k emits as many tokens a second as plain decode (1 + a + ... + a^k = the ratio).

Also: `k=auto`, the default adaptive draft policy (up to the largest k), against no drafting
at every temperature and every `--streams` count (s > 1: s requests at once, as a server meets
s concurrent users; the engines capture a graph of exactly each such batch) — the 5% rule: drafting may never cost more than 5% of plain decoding's
tokens a second — with the k's it chose over the run (`chosen_k`: steps per k, probes included)
and the step-cost table it chose from (`decode_costs_ms`); and `profile`: where the time of a graphed k-draft step goes, each piece
(verify forward, vocab projection + argmax, acceptance, MTP pass, draft heads, drafting
steps) captured and replayed as its own CUDA graph, next to the whole step's graph and the
plain decode graph (GPU with CUDA graphs only).

`--batch-invariant`: every engine runs in batch-invariant mode (docs/engine.md), so greedy with
drafting must equal plain greedy on every prompt (`greedy_divergence`'s `equal_per_prompt`), and
one more plain engine runs without it: `batch_invariant_cost` is the mode's step time (TPOT, all
sequences decoding) and single-stream tok/s against it, in the same run.

Method: every engine serves every shape once before anything is timed (graphs captured,
kernels compiled and tuned): the warm-up prefills a prompt of random ids of every length a
timed prompt has (Triton specializes kernels on sizes, so a new length can compile inside a
timed run) and decodes with every k (each temperature's runs start the adaptive engine's draft
policy afresh: its measured step costs, no acceptance statistics);
each timed request uses a prompt no earlier one used, and prefix caching is off, so no run
inherits another's work; the engines stay up side by side and each repeat runs every
configuration in turn on its prompts (a shared machine's load moves within minutes); each
figure is measured over several repeats and reported as min and median.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import jetserve
from jetserve.bench.common import SHAPES, environment, write_results

PROMPTS_FILE = Path(__file__).with_name("mtp_prompts.json")
MAX_MODEL_LEN, BLOCK_SIZE = 1024, 16
DEFAULT_PLAIN = "plain, not batch-invariant"  # --batch-invariant: the engine its cost is measured against
WARM_UP = "def warm_up(value):\n    \"\"\"Return the value, warmed.\"\"\"\n"


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=str(Path(jetserve.__file__).parent / "models" / "demo"),
                        help="checkpoint with MTP heads (default: the bundled demo model)")
    parser.add_argument("--shape", choices=[s for s in SHAPES if s != "demo"],
                        help="random weights of this Qwen3 shape with one MTP layer: step times only")
    parser.add_argument("--ks", default="1,2,3,4", help="draft lengths to measure")
    parser.add_argument("--temperatures", default="0,0.7", help="0 is greedy")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens generated per prompt")
    parser.add_argument("--prompts-per-repeat", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats, each on fresh prompts")
    parser.add_argument("--batch-sizes", default="1,8", help="batch sizes of the step-time measurement")
    parser.add_argument("--streams", default="1", help="concurrent requests of the generation runs, e.g. 1,4,8,32")
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed per repeat")
    parser.add_argument("--draft-vocab-size", type=int, help="draft heads over the N token ids the engine emits "
                        "most (default: the engine's, at most 32768; the vocabulary's size or more: every id)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="every engine in batch-invariant mode, plus a plain engine without it (its cost: "
                             "'batch_invariant_cost'); greedy_divergence then says per prompt whether greedy with "
                             "drafting equals plain greedy")


def break_even_acceptance(ratio: float, k: int) -> float | None:
    """The per-position acceptance a with 1 + a + ... + a^k = ratio (None: never pays)."""
    if k == 0 or ratio >= k + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(mid ** j for j in range(k + 1)) < ratio else (low, mid)
    return round(low, 4)


def _generation_entry(runs: list[dict], k: int | None, temperature: float, adaptive: bool) -> dict:
    """One configuration's generation figures over its repeats."""
    drafts = sum(r["drafts"] for r in runs)
    positions = max(len(r["per_position"]) for r in runs)
    per_position = [sum(r["per_position"][j] for r in runs if j < len(r["per_position"])) for j in range(positions)]
    return {"k": "auto" if adaptive else k, "temperature": temperature,
            "tok_s": _summary([r["tok_s"] for r in runs], 1),
            "ttft_ms": _summary([r["ttft_ms"] for r in runs], 3),  # a request's median, per repeat
            "decode_tok_s": _summary([r["decode_tok_s"] for r in runs], 1),  # after the first token
            "acceptance_per_position": [round(a / drafts, 4) for a in per_position] if drafts else [],
            "mean_accepted_length": round(1 + sum(r["accepted"] for r in runs) / drafts, 3) if drafts else 1.0,
            "outputs": [o for r in runs for o in r["outputs"]]}


def _summary(values: list[float], digits: int = 6) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "runs": [round(v, digits) for v in values]}


def _draft_vocab_size(model: str, asked: int | None) -> int:
    """The draft vocabulary the drafting engines ran with (speculative_config's resolution)."""
    from jetserve.engine.config import DRAFT_VOCAB_SIZE

    directory = jetserve.demo_model_dir() if model == jetserve.DEMO_MODEL and not Path(model).is_dir() else model
    vocab = json.loads((Path(directory) / "config.json").read_text())["vocab_size"]
    return min(asked or DRAFT_VOCAB_SIZE, vocab)


def _engine(model: str, k: int | None, args, sizes: list[int], adaptive: bool = False, invariant: bool = True):
    from jetserve.engine import LLM

    spec = ({"method": "mtp", "num_speculative_tokens": k, "adaptive": adaptive,
             "draft_vocab_size": args.draft_vocab_size} if k else None)
    max_num_seqs = max(sizes)
    # A KV cache of what the runs need (every sequence at max_model_len, and its drafts), not of the
    # GPU's free memory: the engines stay up side by side for the interleaved runs.
    blocks = max_num_seqs * -(-(MAX_MODEL_LEN + (k or 0) + 1) // BLOCK_SIZE) + 1
    return LLM(model, speculative_config=spec, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
               max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False,
               cudagraph_capture_sizes=sizes, block_size=BLOCK_SIZE, num_kv_blocks=blocks,
               batch_invariant=args.batch_invariant and invariant)


def _set_k(llm, k: int | None) -> None:
    """k drafts a step (None: leave an adaptive engine's draft policy alone)."""
    if llm.engine.draft_policy is not None and k is not None:
        llm.engine.set_num_speculative_tokens(k)


def _warm_lengths(llm, k: int | None, lengths: set[int], temperatures: list[float]) -> None:
    """Prefill a prompt of random ids of each length, then decode a few tokens with k drafts:
    every kernel specialization a timed prompt will need is compiled before timing."""
    import torch

    from jetserve.engine import SamplingParams

    _set_k(llm, k)
    gen = torch.Generator().manual_seed(1)
    vocab = llm.engine.config.model_config.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(1, vocab, (n,), generator=gen).tolist()} for n in sorted(lengths)]
    for temperature in temperatures or [0.0]:
        for prompt in prompts:  # one at a time, like the timed runs
            llm.generate([prompt], SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=0),
                         use_tqdm=False)


def _step_times(llm, k: int, batch: int, prompts: list, args) -> float:
    """Seconds a decode step takes for `batch` sequences drafting k (all decoding, none
    finishing): `args.steps` consecutive engine steps, past the prefill and the first drafts, over
    their count. Not a median of calls: with async scheduling a call launches one step and returns
    the one before, so only the period means anything."""
    from jetserve.engine import SamplingParams

    engine = llm.engine
    _set_k(llm, k)
    params = SamplingParams(temperature=0, max_tokens=(args.steps + 4) * 5, ignore_eos=True)
    ids = [f"t{time.monotonic_ns()}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    for _ in range(4):  # the prefill and the first drafts (the general path)
        engine.step()
    start, steps = time.perf_counter(), 0
    while steps < args.steps:
        outputs = engine.step()
        steps += 1
        if any(o.finished for o in outputs):
            raise RuntimeError(f"a request finished inside the timed steps (k={k}, batch {batch})")
    seconds = (time.perf_counter() - start) / steps
    for request_id in ids:
        engine.abort(request_id)
    return seconds


def _generate(llm, k: int, temperature: float, prompts: list, args, streams: int = 1) -> dict:
    """Decode over `prompts`, `streams` requests at a time: tok/s, acceptance, and apart each
    request's time to the first token (prefill, first drafts) and its tok/s after it."""
    from jetserve.engine import SamplingParams

    engine = llm.engine
    _set_k(llm, k)
    before = engine.stats()
    tokens, seconds, outputs, ttfts, decode_tok_s = 0, 0.0, [], [], []
    for first in range(0, len(prompts), streams):
        group = prompts[first:first + streams]
        params = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=first + i)
                  for i in range(len(group))]
        start = time.perf_counter()
        outs = llm.generate(group, params, use_tqdm=False)
        seconds += time.perf_counter() - start
        for out in outs:
            tokens += len(out.outputs[0].token_ids)
            outputs.append(out.outputs[0].token_ids)
            metrics = out.metrics  # apart: a request's start (prefill, first drafts) and its decoding
            ttfts.append(metrics.first_token_time - metrics.arrival_time)
            decode_tok_s.append((len(out.outputs[0].token_ids) - 1) / (metrics.finished_time - metrics.first_token_time))
    after = engine.stats()
    drafts = after.num_drafts - before.num_drafts
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    per_position = [a - b for a, b in zip(after.accepted_per_position,
                                          before.accepted_per_position + [0] * len(after.accepted_per_position))]
    return {"tok_s": tokens / seconds, "drafts": drafts, "accepted": accepted, "per_position": per_position[:k],
            "outputs": outputs, "ttft_ms": statistics.median(ttfts) * 1e3,
            "decode_tok_s": statistics.median(decode_tok_s)}


def _profile_step(llm, k: int, batch: int, prompts: list, args) -> dict:
    """Microseconds of each piece of a graphed step verifying and proposing k drafts for `batch`
    sequences, each captured and replayed as its own CUDA graph over the static inputs a real
    step left (spec_decode.speculative_step, piece by piece), next to the whole step's graph
    and the plain decode graph. The pieces rewrite KV entries the real step wrote already; a
    piece replayed alone finds its weights in L2 more often than inside the step, so the whole
    step's time is the truth and the pieces say where it goes."""
    import torch

    from jetserve.engine.model.kernels import graph_time

    runner = llm.engine.runner
    graphs = runner.graphs
    _step_times(llm, k, batch, prompts, type(args)(**{**vars(args), "steps": 6}))  # stage a real step
    bucket = graphs.key(k, k + 1, batch, 1)[2]
    with torch.inference_mode():
        pieces = step_pieces(graphs, k, bucket)
        times = {name: graph_time([fn]) * 1e3 for name, fn in pieces.items()}
        times["whole step graph"] = _replay_us(graphs.graphs[k, k + 1, bucket])
        times["plain decode graph"] = _replay_us(graphs.graphs[None, 1, bucket])
    times["sum of pieces"] = (sum(v for name, v in times.items() if "graph" not in name)
                              + (k - 1) * times["draft head (final norm + vocab projection), each"]
                              + max(k - 2, 0) * times.get("drafting step (argmax + input + MTP layer), each", 0.0))
    result = {name: round(v, 1) for name, v in times.items()}
    result["kernels, whole step graph"] = _kernel_list(graphs.graphs[k, k + 1, bucket])
    result["kernels, plain decode graph"] = _kernel_list(graphs.graphs[None, 1, bucket])
    return result


def step_pieces(graphs, k: int, bucket: int) -> dict:
    """The pieces of spec_decode.speculative_step for `bucket` sequences verifying and proposing
    k drafts, as functions over the graphs' static inputs (as staged by the last step), each
    to be captured and timed alone (under inference mode)."""
    import torch

    model, kv, q = graphs.model, graphs.kv_cache, k + 1
    n, meta = bucket * q, graphs.meta(q, bucket)
    ids, positions = graphs.ids[:n], graphs.positions[:n]
    accept = graphs.acceptance(q, bucket)
    rope = model.rotary(positions, model.dtype)
    hidden = model(ids, positions, kv, meta, rope)
    target = graphs.draw(model.compute_logits(hidden), q, bucket).view(-1, q)
    x, res = model.mtp_layer(0, model.draft_input(0, target.flatten(), hidden), rope, kv, meta)
    packed = torch.zeros(bucket, q + 1 + k, dtype=torch.long, device=ids.device)
    xl, rl, chain = accept(ids, target, positions, x, res, k - 1, packed)
    logits, total = model.draft_logits(0, xl, rl)
    pieces = {
        "RoPE rows": lambda: model.rotary(positions, model.dtype),
        "verify forward": lambda: model(ids, positions, kv, meta, rope),
        "vocab projection + draw (verify rows)": lambda: graphs.draw(model.compute_logits(hidden), q, bucket),
        "MTP pass (input + layer)": lambda: model.mtp_layer(0, model.draft_input(0, target.flatten(), hidden), rope,
                                                            kv, meta),
        "acceptance + drafting inputs": lambda: accept(ids, target, positions, x, res, k - 1, packed),
        "draft head (final norm + vocab projection), each": lambda: model.draft_logits(0, xl, rl),
    }
    if chain:
        norm = model.mtp[0].norm
        pieces["drafting step (argmax + input + MTP layer), each"] = lambda: model.mtp_layer(
            1, model.draft_input(1, logits, total, norm, packed[:, q + 1]), chain[0][0], kv, chain[0][1])
    return pieces


def _kernel_list(graph) -> dict:
    """One replay under torch.profiler: the kernels it ran, in order, with their µs on the device,
    and their count and total (launch gaps are the rest of the replay's time)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
               if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    return {"count": len(kernels), "device_us": round(sum(t for _, t in kernels), 1),
            "kernels": [[name[:60], round(t, 2)] for name, t in kernels]}


def _replay_us(graph, repeat: int = 50) -> float:
    import torch

    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / repeat


def _divergence(plain: list[list[int]], drafted: list[list[int]]) -> dict:
    """Where greedy with drafting first differs from greedy without (bf16 rounding: a verify row
    and a decode row are different GEMM shapes)."""
    first = [next((i for i, (a, b) in enumerate(zip(p, d)) if a != b), None) for p, d in zip(plain, drafted)]
    diverged = [f for f in first if f is not None]
    return {"prompts": len(first), "diverged": len(diverged), "first_divergence_positions": diverged,
            "equal_per_prompt": [f is None for f in first]}


def _random_checkpoint_with_mtp(shape: str, directory: Path, dtype, device) -> None:
    """A random Qwen3 of `shape` plus one random MTP layer (Qwen3-Next names), for step times."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from jetserve.bench.common import random_checkpoint

    model = random_checkpoint(shape, directory, dtype, device)
    state = model.state_dict()
    hidden = model.config.hidden_size
    heads = {f"mtp.layers.0.{name[len('model.layers.0.'):]}": t.detach().cpu().contiguous()
             for name, t in state.items() if name.startswith("model.layers.0.")}
    heads["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden) * 0.02).to(dtype)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        heads[f"mtp.{name}.weight"] = torch.ones(hidden, dtype=dtype)
    del model, state
    save_file(heads, directory / "mtp.safetensors")
    index = directory / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else {}
    if not weight_map:
        with safe_open(directory / "model.safetensors", "pt") as f:
            weight_map = {name: "model.safetensors" for name in f.keys()}
    weight_map.update({name: "mtp.safetensors" for name in heads})
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((directory / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))


def run(args) -> dict:
    import torch

    from jetserve.engine.config import resolve_device

    ks = [int(k) for k in args.ks.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    streams = [int(s) for s in args.streams.split(",")]
    sizes = sorted({1, *batch_sizes, *streams})  # the captured buckets: each measured batch exactly
    device = torch.device(resolve_device(args.device))
    scratch = None
    model = args.model
    if args.shape:
        scratch = tempfile.TemporaryDirectory()
        dtype = torch.bfloat16 if args.dtype in ("auto", "bfloat16") else getattr(torch, args.dtype)
        _random_checkpoint_with_mtp(args.shape, Path(scratch.name), dtype, device)
        model = scratch.name
    held_out = json.loads(PROMPTS_FILE.read_text())
    prompts = list(held_out["prompts"])
    n = args.prompts_per_repeat
    if not args.shape and n * args.repeats + max(batch_sizes) > len(prompts):
        raise SystemExit(f"{len(prompts)} held-out prompts: fewer than {n} x {args.repeats} repeats + a batch")
    temperatures = [] if args.shape else [float(t) for t in args.temperatures.split(",")]
    gen = torch.Generator().manual_seed(0)

    def step_prompts(batch):  # fresh each call: random ids on random weights, held-out text otherwise
        if args.shape:
            return [{"prompt_token_ids": torch.randint(100, 50000, (32,), generator=gen).tolist()}
                    for _ in range(batch)]
        return prompts[n * args.repeats:n * args.repeats + batch]

    step_time: dict[str, dict] = {}
    generation: dict[str, dict] = {}
    profile: dict[str, dict] = {}
    # (engine's k: None = no drafting; adaptive; the k each run drafts, None = as the engine decides;
    # batch-invariant where --batch-invariant asks)
    engines = [(None, False, [0], True), (max(ks), False, ks, True)] + (
        [(max(ks), True, [None], True)] if temperatures else [])
    if args.batch_invariant:  # the mode's cost: plain decoding without it, in the same run
        engines.insert(1, (None, False, [0], False))
    configs = []  # (label, engine, k, adaptive): every engine stays up for the interleaved generation runs
    for engine_k, adaptive, mine, invariant in engines:
        llm = _engine(model, engine_k, args, sizes, adaptive, invariant)
        for k in mine:  # warm every shape this engine will run
            if not adaptive:
                for batch in batch_sizes:
                    _step_times(llm, k, batch, step_prompts(batch), type(args)(**{**vars(args), "steps": 4}))
            # The held-out prompts' token counts (Triton's sizes), for an adaptive engine too.
            if temperatures and (device.type == "cuda" or adaptive):
                _warm_lengths(llm, k, {len(llm.engine.tokenizer.encode(p)) for p in prompts}, temperatures)
        if engine_k and not adaptive and device.type == "cuda" and llm.engine.runner.graphs is not None:
            for b in batch_sizes:
                profile[f"k={engine_k} batch {b}"] = _profile_step(llm, engine_k, b, step_prompts(b), args)
                print(f"profile k={engine_k} batch {b}: {profile[f'k={engine_k} batch {b}']}", flush=True)
        for k in mine:
            label = ("plain" if invariant else DEFAULT_PLAIN) if engine_k is None else "k=auto" if adaptive else f"k={k}"
            if not adaptive:
                step_time[label] = {f"batch {b}": _summary([_step_times(llm, k, b, step_prompts(b), args)
                                                             for _ in range(args.repeats)]) for b in batch_sizes}
                print(f"{label}: step {step_time[label]}", flush=True)
            if temperatures:
                configs.append((label, llm, k, adaptive))
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    reused = False
    for s, temperature in ((s, t) for s in streams for t in temperatures):
        # Interleaved: each repeat runs every configuration in turn on its fresh prompts, so a
        # shared machine's load, which moves within minutes, weighs on all alike.
        count = s * -(-n // s)  # a repeat's prompts: whole groups of s
        windows = [prompts[r * n:(r + 1) * n] if s == 1 else
                   [prompts[(r * count + i) % len(prompts)] for i in range(count)] for r in range(args.repeats)]
        reused |= s > 1 and count * args.repeats > len(prompts)  # prefix caching is off: no run inherits work
        for label, llm, k, adaptive in configs:
            if s > 1:  # the batches' prefill sizes, untimed (the single stream's were warmed above)
                _generate(llm, k, temperature, windows[-1][:s], args, s)
            if adaptive:  # as a server meeting this workload afresh: step costs known, no acceptance
                llm.engine.draft_policy.reset()
        runs = {label: [] for label, *_ in configs}
        for r in range(args.repeats):
            for label, llm, k, _ in configs:
                runs[label].append(_generate(llm, k, temperature, windows[r], args, s))
        for label, llm, k, adaptive in configs:
            generation[_key(label, temperature, s)] = entry = _generation_entry(runs[label], k, temperature, adaptive)
            entry["streams"] = s
            if adaptive:  # what the draft policy chose, and the step costs and acceptance it chose from
                policy = llm.engine.draft_policy
                entry["final_k"] = policy.k
                entry["chosen_k"] = {str(k): n for k, n in enumerate(policy.chosen)}
                entry["alphas"] = [round(a, 4) for a in policy.alphas]
                entry["decode_costs_ms"] = {f"k={k} batch {b}": round(t * 1e3, 4)
                                            for (k, b), t in sorted(policy.costs.table.items())}
            print(f"{_key(label, temperature, s)}: {entry['tok_s']} acceptance {entry['acceptance_per_position']} "
                  f"mean length {entry['mean_accepted_length']} k {entry.get('final_k', entry['k'])}"
                  + (f" chosen {entry['chosen_k']}" if adaptive else ""), flush=True)
    configs.clear()
    plain = step_time["plain"]
    for label, times in step_time.items():
        k = 0 if label.startswith("plain") else int(label[2:])
        for b in batch_sizes:
            entry = times[f"batch {b}"]
            entry["ratio_to_plain"] = round(entry["median"] / plain[f"batch {b}"]["median"], 3)
            entry["break_even_acceptance"] = break_even_acceptance(entry["ratio_to_plain"], k)
    for s, temperature in ((s, t) for s in streams for t in temperatures):
        base = generation[_key("plain", temperature, s)]
        for label in [f"k={k}" for k in ks] + ["k=auto"]:
            entry = generation[_key(label, temperature, s)]
            entry["speedup"] = round(entry["tok_s"]["median"] / base["tok_s"]["median"], 3)
            entry["speedup_min"] = round(entry["tok_s"]["min"] / base["tok_s"]["min"], 3)
            # Each repeat ran every configuration in turn: the ratio within a repeat sees one host load.
            entry["speedup_paired"] = round(statistics.median(
                e / b for e, b in zip(entry["tok_s"]["runs"], base["tok_s"]["runs"])), 3)
            if temperature == 0:
                entry["greedy_divergence"] = _divergence(base["outputs"], entry["outputs"])
    cost = None
    if args.batch_invariant:  # > 1: the mode is slower; step time is the TPOT of every sequence decoding
        cost = {"step_time_ratio": {f"batch {b}": round(plain[f"batch {b}"]["median"]
                                                       / step_time[DEFAULT_PLAIN][f"batch {b}"]["median"], 3)
                                    for b in batch_sizes},
                "tok_s_ratio": {_key("", t, s).strip(): round(generation[_key(DEFAULT_PLAIN, t, s)]["tok_s"]["median"]
                                                              / generation[_key("plain", t, s)]["tok_s"]["median"], 3)
                                for s in streams for t in temperatures}}
        print(f"batch-invariant cost: {cost}", flush=True)
    for entry in generation.values():
        del entry["outputs"]
    result = {"benchmark": "mtp", "model": args.shape or args.model, "random_weights": bool(args.shape),
              "dtype": args.dtype, "draft_vocab_size": _draft_vocab_size(model, args.draft_vocab_size),
              "max_tokens": args.max_tokens, "repeats": args.repeats,
              "prompts_per_repeat": n, "prompts": None if args.shape else held_out["about"], "streams": streams,
              "prompts_reused_across_repeats": reused,
              "enforce_eager": args.enforce_eager, "batch_invariant": args.batch_invariant,
              "batch_invariant_cost": cost, "env": environment(device),
              "step_time_s": step_time, "generation": generation, "profile_us": profile}
    write_results(args.out, result, {"mtp": _figure(result, ks, batch_sizes, temperatures, streams[0])}
                  if args.out else {})
    if scratch is not None:
        scratch.cleanup()
    return result


def _key(label: str, temperature: float, streams: int) -> str:
    """A generation entry's name: the single stream's as it always was, others' with their count."""
    return f"{label} T={temperature:g}" + (f" streams {streams}" if streams > 1 else "")


def _figure(result, ks, batch_sizes, temperatures, streams):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if temperatures else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    axes = list(axes) if panels > 1 else [axes]
    steps = result["step_time_s"]
    width = 0.8 / len(batch_sizes)
    for i, b in enumerate(batch_sizes):
        labels = ["plain"] + [f"k={k}" for k in ks]
        axes[0].bar([x + (i - (len(batch_sizes) - 1) / 2) * width for x in range(len(labels))],
                    [steps[label][f"batch {b}"]["ratio_to_plain"] for label in labels], width, label=f"batch {b}")
        axes[0].set_xticks(range(len(labels)), labels)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set(ylabel="step time / plain decode step", title=f"{result['model'].split('/')[-1]}: step cost")
    axes[0].legend()
    if temperatures:
        gen = result["generation"]
        for temperature, style in zip(temperatures, ["-", "--", ":"]):
            for k in ks:
                entry = gen[_key(f"k={k}", temperature, streams)]
                axes[1].plot(range(1, k + 1), entry["acceptance_per_position"], style, marker="o",
                             label=f"k={k} T={temperature:g} (mean len {entry['mean_accepted_length']:.2f})")
        axes[1].set(xlabel="draft position", ylabel="fraction accepted up to here", ylim=(0, 1.02),
                    title="acceptance (held-out prompts)")
        axes[1].legend(fontsize=7)
        width = 0.8 / len(temperatures)
        for i, temperature in enumerate(temperatures):
            labels = ["plain"] + [f"k={k}" for k in ks]
            axes[2].bar([x + (i - (len(temperatures) - 1) / 2) * width for x in range(len(labels))],
                        [gen[_key(label, temperature, streams)]["tok_s"]["median"] for label in labels], width,
                        label=f"T={temperature:g}")
            axes[2].set_xticks(range(len(labels)), labels)
        axes[2].set(ylabel=f"decode tok/s ({streams} stream(s), median)", title="decode speed")
        axes[2].legend()
    fig.tight_layout()
    return fig
