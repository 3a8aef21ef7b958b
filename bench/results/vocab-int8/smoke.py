"""On a GPU: the demo (tied) with --quantization int8 / int4: the vocab projection INT8, the embedding
read from it, plain greedy equal to MTP k=3 drafting (lossless), CUDA graphs; 32-row batches too."""
import pathlib

import jetserve
from jetserve.engine import LLM, SamplingParams
from jetserve.engine.model import quant

demo = str(pathlib.Path(jetserve.__file__).parent / "models" / "demo")
greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 8000 + 5 for j in range(3 + 5 * i)]} for i in range(40)]
for method in ("int8", "int4"):
    plain = LLM(demo, quantization=method, max_num_seqs=64, max_model_len=512)
    m = plain.engine.runner.model
    assert isinstance(m.embed_tokens, quant.QuantEmbedding) and m.lm_head.bits == 8
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    del plain
    spec = LLM(demo, quantization=method, max_num_seqs=64, max_model_len=512,
               speculative_config={"method": "mtp", "num_speculative_tokens": 3, "adaptive": False})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, greedy, use_tqdm=False)]
    s = spec.engine.stats()
    same = sum(a == b for a, b in zip(ref, got))
    print(f"[smoke] {method}: {same}/{len(ref)} prompts equal with MTP k=3, accepted {s.num_accepted_tokens}/{s.num_draft_tokens}", flush=True)
    del spec
