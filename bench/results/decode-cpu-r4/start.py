"""One start of the README's LLM snippet in a fresh process: seconds to a ready engine, programs compiled / loaded."""
import json, os, time
t0 = time.perf_counter()
from jetserve.engine import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(model="demo", max_num_seqs=8, max_num_batched_tokens=256)
t2 = time.perf_counter()
out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
g = llm.engine.runner.graphs
print(json.dumps({"import_s": round(t1 - t0, 2), "engine_start_s": round(t2 - t1, 2), "generate_s": round(time.perf_counter() - t2, 2),
                  "compiled_s": g.compile_seconds, "loaded_s": g.load_seconds, "load_average_1min": os.getloadavg()[0],
                  "text_head": out[0].outputs[0].text[:30]}))
