"""The engine core in its own process behind a live gRPC server: the same answers as in a thread,
stop strings exact across the boundary, blocks freed by aborts and cancels, slow readers served
merged deltas, control calls in effect when they reply, and a dead core seen at once."""

import asyncio
import os
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jetserve import demo_model_dir
from jetserve.engine import SamplingParams
from jetserve.engine.tokenizer import Tokenizer
from tests.server.conftest import LiveServer, engine_factory, greedy, wait_for_free_blocks
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def core(tiny_model):
    """A server whose engine core runs in its own process."""
    server = LiveServer(engine_factory(tiny_model, max_num_seqs=4, engine_core_process=True))
    server.wait_loaded()
    yield server
    server.stop()


def generate(server, text, sampling, **kwargs):
    with server.channel() as channel:
        return list(pb_grpc.InferenceServiceStub(channel).Generate(
            pb.GenerateRequest(text=text, sampling=sampling), **kwargs))


def test_the_core_runs_in_another_process_and_answers_as_the_thread_does(core, live):
    assert core.engine.core.process.poll() is None and core.engine.core.process.pid != os.getpid()
    for text in ("The kiosk", "robot arm"):
        mine = generate(core, text, greedy(24, ignore_eos=True))
        theirs = generate(live, text, greedy(24, ignore_eos=True))
        assert "".join(m.text for m in mine) == "".join(m.text for m in theirs)
        assert [t for m in mine for t in m.token_ids] == [t for m in theirs for t in m.token_ids]
        assert mine[-1].finish_reason == pb.FINISH_REASON_LENGTH and mine[-1].usage.completion_tokens == 24


def test_aborts_and_cancels_free_every_block_across_the_process_boundary(core):
    with core.channel() as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        long = greedy(400, ignore_eos=True)
        cancelled = [stub.Generate(pb.GenerateRequest(text="robot %d" % i, sampling=long)) for i in range(3)]
        for call in cancelled:
            next(call)
        assert core.engine.stats().kv_blocks_used > 0
        for call in cancelled:
            call.cancel()
        left = stub.Generate(pb.GenerateRequest(text="kiosk", sampling=long))
        next(left)
        left.cancel()  # and one that leaves mid-stream the other way: its deadline passes, set at
        # half of a whole stream timed on this machine (a fixed one let a quiet machine finish
        # first), halved again, at most three times, while the machine, quieter than when it was
        # timed, still finishes the stream in time
        start = time.monotonic()
        list(stub.Generate(pb.GenerateRequest(text="arm", sampling=long)))
        whole = time.monotonic() - start
        for fraction in (0.5, 0.25, 0.125, 0.0625):
            try:
                list(stub.Generate(pb.GenerateRequest(text="arm", sampling=long), timeout=whole * fraction))
            except grpc.RpcError as late:
                assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                break
        else:
            pytest.fail(f"no deadline passed mid-stream: {whole:.2f} s a whole stream")
    stats = wait_for_free_blocks(core.engine, timeout=30)
    assert (stats.kv_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0)


def test_set_limits_is_in_get_stats_when_its_reply_arrives(core):
    with core.channel() as channel:
        inference, control = pb_grpc.InferenceServiceStub(channel), pb_grpc.ControlServiceStub(channel)
        for n in (2, 3, 4):
            assert control.SetLimits(pb.SetLimitsRequest(max_num_seqs=n), timeout=30).max_num_seqs == n
            assert inference.GetStats(pb.GetStatsRequest(), timeout=10).max_num_seqs == n
        with pytest.raises(grpc.RpcError) as refused:
            control.SetLimits(pb.SetLimitsRequest(max_num_seqs=99), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_num_seqs" in refused.value.details()


def test_a_slow_reader_gets_merged_deltas_not_a_queue(core):
    engine = core.engine

    async def read_late():
        finished = engine.stats().num_requests_finished
        outputs = engine.generate("robot", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        first = await outputs.__anext__()
        while engine.stats().num_requests_finished == finished:  # the core ends it while we do not read
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # its last deltas on their way to the stream
        rest = [out async for out in outputs]
        return first, rest

    first, rest = core.call(read_late())
    assert len(rest) == 1 and rest[0].finished  # 39 tokens, one message
    assert len(first.outputs[0].token_ids) + len(rest[0].outputs[0].token_ids) == 40


def test_a_stop_string_inside_accepted_drafts_ends_where_it_would_without_drafting():
    """The demo model drafts 3 tokens a step; the front end cuts at the token that completes the
    stop string, though the core delivered the whole accepted run."""
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}  # drafting, even where it does not pay
    server = LiveServer(engine_factory(demo_model_dir(), max_model_len=512, speculative_config=spec,
                                       engine_core_process=True))
    server.wait_loaded()
    tokenizer = Tokenizer.from_pretrained(demo_model_dir())
    try:
        free = generate(server, "def add(a, b):\n", greedy(48, ignore_eos=True))
        ids = [t for m in free for t in m.token_ids]
        text = "".join(m.text for m in free)
        # A stop string that a multi-token message completes somewhere inside, not at its end.
        seen, stop = 0, None
        for message in free:
            if len(message.token_ids) > 1:
                for cut in range(seen + 1, seen + len(message.token_ids)):
                    tail = tokenizer.decode(ids[:cut])[-3:]
                    if tail.strip() and tail not in tokenizer.decode(ids[:cut - 1]):
                        stop = tail
                        break
            if stop:
                break
            seen += len(message.token_ids)
        assert stop, "no accepted run of drafts to cut inside"
        stopped = generate(server, "def add(a, b):\n", greedy(48, ignore_eos=True, stop=[stop]))
        assert "".join(m.text for m in stopped) == text[:text.index(stop)]
        kept = [t for m in stopped for t in m.token_ids]
        shortest = next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))
        assert kept == ids[:shortest]
        assert stopped[-1].finish_reason == pb.FINISH_REASON_STOP
        assert wait_for_free_blocks(server.engine, timeout=30).kv_blocks_used == 0
    finally:
        server.stop()


def test_a_killed_core_is_seen_at_once(tiny_model):
    server = LiveServer(engine_factory(tiny_model, engine_core_process=True))
    server.wait_loaded()
    try:
        with server.channel() as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            stream = stub.Generate(pb.GenerateRequest(text="robot", sampling=greedy(500, ignore_eos=True)))
            next(stream)
            server.engine.core.process.kill()
            with pytest.raises(grpc.RpcError) as ended:
                list(stream)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and "died" in ended.value.details()
            for _ in range(200):  # the heartbeat is checked every 0.1 s
                if health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == NOT_SERVING:
                    break
                time.sleep(0.05)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == NOT_SERVING
            assert not server.server.engine_alive  # what gates systemd's WATCHDOG=1
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(pb.GenerateRequest(text="hi", sampling=greedy(2)), timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as control:
                pb_grpc.ControlServiceStub(channel).SetLimits(pb.SetLimitsRequest(max_num_seqs=1), timeout=30)
            assert control.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()  # nothing hangs on a dead core
