"""The offline API, with vLLM's names: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools

from tqdm import tqdm

from jetserve.engine.config import EngineArgs
from jetserve.engine.llm_engine import LLMEngine
from jetserve.engine.outputs import RequestOutput
from jetserve.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **kwargs):
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs).resolve())
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (a string, {"prompt_token_ids": [...]}, or a list of them);
        outputs come back in the order of the prompts."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(sampling_params)} for {len(prompts)} prompts")
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for request_id, prompt, params in zip(ids, prompts, sampling_params):
                self.engine.add_request(request_id, prompt, params)
        except ValueError:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    if delta.request_id in results:
                        results[delta.request_id].merge(delta)
                    else:
                        results[delta.request_id] = delta
                    bar.update(delta.finished)
        for out in results.values():  # vLLM's type for the caller; the engine kept one int32 array
            out.prompt_token_ids = list(out.prompt_token_ids)
        return [results[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, **template_kwargs) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {role, content}) or several, rendered
        with the model's chat template (content is text: no forged control tokens), then completed."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text, ids = tokenizer.encode_chat(conversation, **template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)
