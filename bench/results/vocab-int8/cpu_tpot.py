"""TPOT on this CPU through LLM.generate: the demo, default dtype, bf16 / INT8 / INT4, fresh prompts."""
import json, pathlib, statistics, sys, time
import jetserve
from jetserve.engine import LLM, SamplingParams
demo = str(pathlib.Path(jetserve.__file__).parent / "models" / "demo")
out = {}
for q in (None, "int8", "int4"):
    llm = LLM(demo, device="cpu", max_num_seqs=1, max_model_len=512, quantization=q)
    p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], p, use_tqdm=False)
    ts = []
    for i in range(5):
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": [11 + i, 900 + 7 * i, 7, 100 + i]}], p, use_tqdm=False)
        ts.append((time.perf_counter() - t) / 64 * 1e3)
    out[q or "bf16"] = {"dtype": llm.engine.config.dtype, "min_ms": round(min(ts), 3), "median_ms": round(statistics.median(ts), 3)}
    print(sys.argv[1], q or "default", out[q or "bf16"], flush=True)
    del llm
print(json.dumps(out))
