"""Health across load and drain, reflection, Prometheus metrics and GetStats."""

import threading
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from conftest import LiveServer, engine_factory, greedy
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_health_goes_not_serving_serving_not_serving_across_load_and_drain(tiny_model):
    gate = threading.Event()
    make_engine = engine_factory(tiny_model)
    statuses = []

    def held_load(on_status):  # the real load, held until the test has looked at "loading"
        gate.wait(30)
        return make_engine(lambda text: statuses.append(text) or on_status(text))

    server = LiveServer(held_load)
    channel = server.channel()
    health = health_pb2_grpc.HealthStub(channel)
    inference, control = pb_grpc.InferenceStub(channel), pb_grpc.ControlStub(channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service="jetserve.v1.Inference"), timeout=60)
    try:
        assert next(watch).status == NOT_SERVING
        assert health.Check(health_pb2.HealthCheckRequest()).status == NOT_SERVING
        for call in (lambda: list(inference.Generate(pb.GenerateRequest(text="hi"))),
                     lambda: inference.GetModelInfo(pb.GetModelInfoRequest())):
            try:
                call()
                raise AssertionError("served before the model was loaded")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and "loading" in exc.details()

        gate.set()
        assert next(watch).status == SERVING
        assert health.Check(health_pb2.HealthCheckRequest()).status == SERVING
        assert statuses  # the engine reported its progress ("loading weights ...")
        assert list(inference.Generate(pb.GenerateRequest(text="hi", sampling=greedy(2))))[-1].finish_reason

        control.Drain(pb.DrainRequest())
        assert next(watch).status == NOT_SERVING
        control.Resume(pb.ResumeRequest())
        assert next(watch).status == SERVING

        stopper = threading.Thread(target=server.stop)
        stopper.start()
        assert next(watch).status == NOT_SERVING  # shutdown drains first
        stopper.join(30)
    finally:
        gate.set()
        watch.cancel()
        channel.close()


def test_resume_is_refused_once_shutting_down(tiny_model):
    server = LiveServer(engine_factory(tiny_model))
    server.wait_loaded()
    server.server.stopping = True  # what shutdown() sets first
    with server.channel() as channel:
        try:
            pb_grpc.ControlStub(channel).Resume(pb.ResumeRequest())
            raise AssertionError("resumed during shutdown")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "shutting down" in exc.details()
    server.stop()


def test_reflection_lists_the_services(live):
    with live.channel() as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"jetserve.v1.Inference", "jetserve.v1.Control", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= services
        proto = database.FindFileContainingSymbol("jetserve.v1.Inference")
        assert proto.package == "jetserve.v1"
        assert {m.name for m in proto.service[0].method} >= {"Generate", "Chat", "GetModelInfo", "GetStats"}


def scrape(server):
    url = "http://127.0.0.1:%d/metrics" % server.server.metrics_port
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_metrics_scrape_shows_the_counters_moving(stubs, live):
    inference, _ = stubs
    before = scrape(live)
    for name in ("jetserve:num_requests_running", "jetserve:num_requests_waiting", "jetserve:kv_cache_usage_perc",
                 "jetserve:spec_decode_num_draft_tokens_total", "jetserve:spec_decode_num_accepted_tokens_total"):
        assert (name, ()) in before, name

    messages = list(inference.Generate(pb.GenerateRequest(text="The kiosk", sampling=greedy(5, ignore_eos=True))))
    after = scrape(live)

    def moved(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0)

    assert moved("jetserve:generation_tokens_total") == 5
    assert moved("jetserve:prompt_tokens_total") == messages[-1].usage.prompt_tokens > 0
    assert moved("jetserve:request_success_total", (("finished_reason", "length"),)) == 1
    assert moved("jetserve:time_to_first_token_seconds_count") == 1
    assert moved("jetserve:inter_token_latency_seconds_count") == 4
    assert moved("jetserve:e2e_request_latency_seconds_count") == 1
    assert after[("jetserve:kv_cache_usage_perc", ())] == 0.0  # all blocks back


def test_get_stats_reports_the_engine_and_latency_percentiles(stubs, live):
    inference, _ = stubs
    list(inference.Generate(pb.GenerateRequest(text="robot", sampling=greedy(6, ignore_eos=True))))
    stats = inference.GetStats(pb.GetStatsRequest())
    assert stats.kv_blocks_total == 256 and stats.max_num_seqs == live.engine.stats().max_num_seqs
    assert stats.num_requests_finished >= 1 and not stats.draining
    for latency in (stats.time_to_first_token, stats.inter_token_latency):
        assert latency.count >= 1 and 0 < latency.p50_s <= latency.p90_s <= latency.p99_s
    info = inference.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.architecture, info.vocab_size, info.max_model_len, info.has_chat_template) == \
        ("Qwen3ForCausalLM", 400, 512, True)
