"""INT4 on a CPU through the public API: a random 4-layer Qwen3 (hidden 1024, vocab 4096, about 50 M
weights; built by transformers) served by `LLM(..., device="cpu")` with the default flags, as float
(fp32 and bf16, compiled decode steps) and as `quantization="int4"` (its default dtype, and fp32
as before INT4 took torch's CPU kernel). Batch 1, 33 greedy tokens after a fresh 20-token prompt,
its whole generate() over the tokens (prefill included, a small share). Eight prompts, two seconds
apart (the background compiles land); the min and median of the last four. `python tools/cpu_int4_probe.py OUT_DIR` writes OUT_DIR/cpu_int4.json and prints a table."""

import json
import statistics
import sys
import time
from pathlib import Path

from jetserve.engine import LLM, SamplingParams

CONFIGS = [("float32", None), ("bfloat16", None), ("auto", "int4"), ("float32", "int4")]


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/cpu-int4")
    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    if not (model / "config.json").exists():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.engine.builders import build_qwen3

        build_qwen3(model, seed=1, vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=512)
    result = {}
    for dtype, quantization in CONFIGS:
        llm = LLM(str(model), device="cpu", dtype=dtype, quantization=quantization, max_num_seqs=1, max_model_len=256)
        params = SamplingParams(temperature=0, max_tokens=33, ignore_eos=True)
        per_token = []
        for i in range(8):
            prompt = [{"prompt_token_ids": list(range(30 + 7 * i, 50 + 7 * i))}]  # fresh: no prefix hit
            began = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            per_token.append((time.perf_counter() - began) / params.max_tokens * 1e3)
            time.sleep(2 if i < 4 else 0)
        last = per_token[4:]
        name = f"{llm.engine.config.dtype} {quantization or 'float'}"
        result[name] = {"requested_dtype": dtype, "ms_per_token_min": round(min(last), 2),
                        "ms_per_token_median": round(statistics.median(last), 2),
                        "compiled": llm.engine.config.cpu_compile is not None}
        print(f"{name:18} {result[name]}", flush=True)
        del llm
    (out / "cpu_int4.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
