"""The Inference and Control services: requests in, engine calls, one message per token delta out."""

from __future__ import annotations

import asyncio
import functools
import uuid

import grpc

from jetserve import __version__
from jetserve.engine import SamplingParams
from jetserve.server.errors import RpcError, status_for
from jetserve.server.guard import WithTokenIds, check_messages, check_request_id, check_room, tokenized
from jetserve.server.metrics import percentiles
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc

FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "abort": pb.FINISH_REASON_ABORT}
FLOAT_OPTIONS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INT_OPTIONS = ("top_k", "max_tokens", "seed", "n", "min_tokens", "logprobs", "prompt_logprobs")
LIST_OPTIONS = ("stop", "stop_token_ids", "allowed_token_ids", "bad_words")


def answers_with_status(method):
    """Turn what a unary method raises into a status with a message (never a traceback)."""
    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - status_for logs the unexpected ones
            code, message = status_for(exc)
        await context.abort(code, message)
    return wrapper


def sampling_params(options: pb.SamplingOptions) -> SamplingParams:
    """Unset fields keep SamplingParams' defaults; it names the field of any bad value."""
    kwargs = {name: getattr(options, name) for name in FLOAT_OPTIONS + INT_OPTIONS
              if options.HasField(name)}
    kwargs.update({name: list(getattr(options, name)) for name in LIST_OPTIONS if getattr(options, name)})
    if options.logit_bias:
        kwargs["logit_bias"] = dict(options.logit_bias)
    return SamplingParams(ignore_eos=options.ignore_eos, include_stop_str_in_output=options.include_stop_str_in_output,
                          **kwargs)


def token_logprobs(token_ids, logprobs, num_top: int | None) -> list[pb.TokenLogprob]:
    """Per token: its logprob and rank, and the `num_top` most likely tokens there."""
    out = []
    for token_id, candidates in zip(token_ids, logprobs or ()):
        chosen = candidates[token_id]
        top = sorted(((t, c) for t, c in candidates.items() if c.rank <= num_top), key=lambda tc: tc[1].rank)
        out.append(pb.TokenLogprob(
            token_id=token_id, token=chosen.decoded_token, logprob=chosen.logprob, rank=chosen.rank,
            top_logprobs=[pb.TopLogprob(token_id=t, token=c.decoded_token, logprob=c.logprob) for t, c in top]))
    return out


def generate_prompt(request: pb.GenerateRequest, token_ids, engine):
    """The engine checks the rest (empty, unknown token ids, too long) and names what is wrong.
    `token_ids`: the ids the parse took out of the message (guard.WithTokenIds), or None."""
    if token_ids is not None:
        return {"prompt_token_ids": token_ids}
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "prompt is not set: set text or token_ids")
    return request.text if kind == "text" else {"prompt_token_ids": request.token_ids.ids}


def chat_prompt(request: pb.ChatRequest, engine) -> dict:
    """Text and token ids of the conversation; content never becomes control tokens."""
    if engine.tokenizer is None:
        raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                       "messages: model %s has no tokenizer, so no chat template; use Generate with token_ids"
                       % engine.model_info.model)
    check_messages(len(request.messages))
    text, ids = engine.tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in request.messages],
                                             max_tokens=engine.model_info.max_model_len)
    return {"prompt": text, "prompt_token_ids": ids}


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    """`server` is the JetServer: its `engine` (None while loading), `stream` and `metrics`."""

    def __init__(self, server):
        self._server = server

    async def Generate(self, request, context):
        request, ids = (request.message, request.token_ids) if isinstance(request, WithTokenIds) else (request, None)
        async for reply in self._stream(context, request.request_id, request.sampling,
                                        functools.partial(generate_prompt, request, ids), pb.GenerateResponse,
                                        tokenizes=ids is None and request.WhichOneof("prompt") != "token_ids"):
            yield reply

    async def Chat(self, request, context):
        async for reply in self._stream(context, request.request_id, request.sampling,
                                        functools.partial(chat_prompt, request), pb.ChatResponse, tokenizes=True):
            yield reply

    async def _stream(self, context, request_id, sampling, make_prompt, response_type, tokenizes: bool):
        try:
            engine = self._server.admit()
            request_id = check_request_id(request_id) if request_id else uuid.uuid4().hex
            params = sampling_params(sampling)
            if tokenizes:  # in a worker thread: a long prompt never stalls the event loop
                prompt = await asyncio.to_thread(lambda: tokenized(make_prompt(engine), engine))
            else:  # token ids: no thread hop before the first token
                prompt = make_prompt(engine)
            check_room(prompt, params, engine.model_info.max_model_len, "sampling.max_tokens")
            completion_tokens = 0
            async for out in self._server.stream(prompt, params, request_id):
                replies = []
                for delta in out.outputs:  # deltas of several of the n completions may come merged
                    completion_tokens += len(delta.token_ids)
                    reply = response_type(request_id=request_id, text=delta.text, token_ids=delta.token_ids,
                                          index=delta.index,
                                          logprobs=token_logprobs(delta.token_ids, delta.logprobs, params.logprobs))
                    if delta.finish_reason:
                        reply.finish_reason = FINISH_REASONS[delta.finish_reason]
                    replies.append(reply)
                if out.prompt_logprobs is not None:  # once, in the stream's first message
                    replies[0].prompt_logprobs.extend(token_logprobs(
                        out.prompt_token_ids[1:], out.prompt_logprobs[1:], params.prompt_logprobs))
                if out.finished:
                    t, last = out.metrics, replies[-1]
                    last.usage.prompt_tokens = len(out.prompt_token_ids)
                    last.usage.completion_tokens = completion_tokens
                    last.timing.total_s = t.finished_time - t.arrival_time
                    last.timing.time_to_first_token_s = (
                        t.first_token_time - t.arrival_time if t.first_token_time is not None else last.timing.total_s)
                for reply in replies:
                    yield reply
            return
        except Exception as exc:  # noqa: BLE001 - status_for logs the unexpected ones
            code, message = status_for(exc)
        await context.abort(code, message)

    @answers_with_status
    async def GetModelInfo(self, request, context):
        engine = self._server.loaded()
        info = engine.model_info
        tokenizer = engine.tokenizer
        return pb.GetModelInfoResponse(
            model=info.served_model_name, architecture=info.architecture, dtype=str(info.dtype),
            device=str(info.device), max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            has_chat_template=tokenizer is not None and tokenizer.chat_template is not None,
            num_mtp_layers=info.num_mtp_layers, num_speculative_tokens=engine.stats().num_speculative_tokens,
            cuda_graphs=info.cuda_graphs, backend=info.backend, version=__version__,
            max_num_seqs_limit=info.max_num_seqs_limit, num_speculative_tokens_limit=info.num_speculative_tokens_limit)

    @answers_with_status
    async def GetStats(self, request, context):
        s = self._server.loaded().stats()
        metrics = self._server.metrics

        def latency(samples):
            p50, p90, p99 = percentiles(samples)
            return pb.LatencyPercentiles(p50_s=p50, p90_s=p90, p99_s=p99, count=len(samples))

        return pb.GetStatsResponse(
            num_waiting=s.num_waiting, num_running=s.num_running, max_num_seqs=s.max_num_seqs,
            kv_blocks_total=s.kv_blocks_total, kv_blocks_used=s.kv_blocks_used, kv_usage=s.kv_usage,
            time_to_first_token=latency(metrics.recent_ttft), inter_token_latency=latency(metrics.recent_itl),
            speculative=pb.SpeculativeStats(
                num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens,
                num_accepted_tokens=s.num_accepted_tokens, accepted_per_position=s.accepted_per_position,
                acceptance_rate=s.acceptance_rate, mean_accepted_length=s.mean_accepted_length,
                num_speculative_tokens=s.num_speculative_tokens,
                buckets=[pb.DraftBucket(batch_size=b, draft_length=k, step_cost_s=costs)
                         for b, k, costs in zip(s.draft_buckets, s.draft_lengths, s.draft_step_costs_s)],
                acceptance_estimate=s.acceptance_estimates, draft_vocab_size=s.draft_vocab_size,
                draft_vocab_coverage=s.draft_vocab_coverage),
            draining=self._server.draining, num_requests_finished=s.num_requests_finished,
            num_preemptions=s.num_preemptions)


class ControlServicer(pb_grpc.ControlServiceServicer):
    """Load shedding for the agent: the same drain as SIGTERM's, without the stop."""

    def __init__(self, server):
        self._server = server

    @answers_with_status
    async def Drain(self, request, context):
        self._server.authorize_control(context)
        await self._server.set_draining(True)
        return self._reply(pb.DrainResponse, "draining: new streams get UNAVAILABLE, open ones finish")

    @answers_with_status
    async def Resume(self, request, context):
        self._server.authorize_control(context)
        await self._server.set_draining(False)
        return self._reply(pb.ResumeResponse, "accepting new streams")

    @answers_with_status
    async def SetLimits(self, request, context):
        self._server.authorize_control(context)
        engine = self._server.loaded()
        # Each returns once the engine applies it between steps (so GetStats already shows it):
        # wait for that off the event loop.
        if request.HasField("max_num_seqs"):
            await asyncio.to_thread(engine.set_max_num_seqs, request.max_num_seqs)
        if request.HasField("num_speculative_tokens"):
            await asyncio.to_thread(engine.set_num_speculative_tokens, request.num_speculative_tokens)
        return self._reply(pb.SetLimitsResponse, "limits set")

    def _reply(self, response_type, message):
        """The limits in effect now."""
        reply = response_type(draining=self._server.draining, message=message)
        if self._server.engine is not None:
            stats = self._server.engine.stats()
            reply.max_num_seqs = stats.max_num_seqs
            reply.num_speculative_tokens = stats.num_speculative_tokens
        return reply
