"""The engine's forward against transformers on one device and dtype (issue 2's bf16 check).

Same random weights (the demo shape, head_dim 64) in both; greedy tokens of a few prompts
(graphs on where the device has them) and prefill logits. In fp32 the tokens must match; in
bf16 both round differently (fused kernels, other GEMM orders), so the report is how close
the logits are and how long the greedy sequences agree.
"""


def add_arguments(p):
    p.add_argument("--device", default="auto")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--new-tokens", type=int, default=16)


PROMPT_LENS = (7, 20, 33, 64)


def run(args) -> dict:
    import tempfile
    from pathlib import Path

    import torch

    from jetserve.bench.common import environment, random_checkpoint, write_results

    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    result = {"env": environment(device), "shape": "demo", "new_tokens": args.new_tokens, "dtypes": {}}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        with tempfile.TemporaryDirectory() as tmp:
            hf = random_checkpoint("demo", Path(tmp), dtype, device)
            result["dtypes"][dtype_name] = _compare(tmp, hf, device, dtype_name, args.new_tokens)
    write_results(args.out, result, {})
    return result


def _compare(model_dir, hf, device, dtype_name, new_tokens) -> dict:
    import torch

    from jetserve.engine import LLM, SamplingParams
    from jetserve.engine.model.attention import AttentionMetadata

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    llm = LLM(model_dir, device=str(device), dtype=dtype_name, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    with torch.inference_mode():
        theirs = [hf.generate(torch.tensor([p], device=device), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        prompt = prompts[-1]
        expected = hf(torch.tensor([prompt], device=device)).logits[0].float()
        runner = llm.engine.runner
        meta = AttentionMetadata.build([len(prompt)], [len(prompt)], [list(range(-(-len(prompt) // 16)))],
                                       runner.block_size, runner.device)
        hidden = runner.model(torch.tensor(prompt, device=device), torch.arange(len(prompt), device=device),
                              runner.kv_cache, meta)
        got = runner.model.compute_logits(hidden).float()
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, theirs)]
    return {
        "cuda_graphs": llm.engine.model_info.cuda_graphs,
        "greedy_tokens_equal": ours == theirs,
        "agreeing_prefix_per_prompt": agree,
        "ours_first_prompt": ours[0], "transformers_first_prompt": theirs[0],
        "prefill_logits_max_abs_diff": round((got - expected).abs().max().item(), 6),
        "prefill_logits_rel_error": round(((got - expected).norm() / expected.norm()).item(), 6),
        "prefill_top1_agreement": round((got.argmax(-1) == expected.argmax(-1)).float().mean().item(), 4),
    }
