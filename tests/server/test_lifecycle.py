"""Health across load and drain, reflection, Prometheus metrics and GetStats."""

import socket
import threading
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import LiveServer, engine_factory, free_port, greedy, wait_for_free_blocks
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
    inference, control = pb_grpc.InferenceServiceStub(channel), pb_grpc.ControlServiceStub(channel)
    watch = health.Watch(health_pb2.HealthCheckRequest(service="jetserve.v1.InferenceService"), timeout=60)
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


def test_a_wedged_engine_turns_health_off_and_gets_no_watchdog_pings(tiny_model, tmp_path, monkeypatch):
    systemd = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    systemd.bind(str(tmp_path / "notify"))
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")  # ping every 0.5 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)

    def pings(seconds):
        """WATCHDOG=1 datagrams arriving within the next `seconds`."""
        deadline, count = time.monotonic() + seconds, 0
        while (left := deadline - time.monotonic()) > 0:
            systemd.settimeout(left)
            try:
                count += systemd.recv(4096) == b"WATCHDOG=1"
            except socket.timeout:
                break
        return count

    def health_is(status, within):
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if health.Check(health_pb2.HealthCheckRequest()).status == status:
                return True
            time.sleep(0.05)
        return False

    server = LiveServer(engine_factory(tiny_model, engine_core_process=False))  # the core in a thread
    server.wait_loaded()
    channel = server.channel()
    health = health_pb2_grpc.HealthStub(channel)
    try:
        assert pings(1.2) >= 2
        # Wedge the real step thread: it runs a 5 s sleep between two steps, where it runs SetLimits.
        monkeypatch.setattr(server.engine.core.core, "set_max_num_seqs", lambda n: time.sleep(5))
        wedge = threading.Thread(target=server.engine.set_max_num_seqs, args=(1,))
        wedge.start()
        assert health_is(NOT_SERVING, within=4)
        pings(0.05)  # sent before it went stale
        assert pings(1.0) == 0
        wedge.join()
        assert health_is(SERVING, within=3)
        assert pings(1.2) >= 1
    finally:
        channel.close()
        server.stop()
        systemd.close()


def test_reflection_lists_the_services(live):
    with live.channel() as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"jetserve.v1.InferenceService", "jetserve.v1.ControlService", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= services
        proto = database.FindFileContainingSymbol("jetserve.v1.InferenceService")
        assert proto.package == "jetserve.v1"
        assert {m.name for m in proto.service[0].method} >= {"Generate", "Chat", "GetModelInfo", "GetStats"}


def scrape(server):
    """{(sample name, labels other than model_name): value}; every sample names the served model."""
    url = "http://127.0.0.1:%d/metrics" % server.server.metrics_port
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == server.engine.model_info.served_model_name, s
            samples[(s.name, tuple(sorted(labels.items())))] = s.value
    return samples


def test_a_metrics_scrape_shows_the_counters_moving(stubs, live):
    inference, _ = stubs
    before = scrape(live)
    for name in ("jetserve_num_requests_running", "jetserve_num_requests_waiting", "jetserve_kv_cache_usage_perc",
                 "jetserve_spec_decode_num_draft_tokens_total", "jetserve_spec_decode_num_accepted_tokens_total"):
        assert (name, ()) in before, name

    messages = list(inference.Generate(pb.GenerateRequest(text="The kiosk", sampling=greedy(5, ignore_eos=True))))
    wait_for_free_blocks(live.engine)
    after = scrape(live)

    def moved(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0)

    assert moved("jetserve_generation_tokens_total") == 5
    assert moved("jetserve_prompt_tokens_total") == messages[-1].usage.prompt_tokens > 0
    assert moved("jetserve_request_success_total", (("finished_reason", "length"),)) == 1
    assert moved("jetserve_time_to_first_token_seconds_count") == 1
    # One inter-token sample a delivered delta after the first (a slow reader's deltas merge).
    assert moved("jetserve_inter_token_latency_seconds_count") == len(messages) - 1
    assert moved("jetserve_e2e_request_latency_seconds_count") == 1
    assert after[("jetserve_kv_cache_usage_perc", ())] == 0.0  # all blocks back


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


def test_speculative_counters_move_per_position():
    """The bundled demo model has an MTP head: drafting shows in metrics, GetStats and SetLimits."""
    from jetserve.server.cli import demo_model_dir

    # Fixed k: on a CPU the adaptive policy rightly keeps drafting off, and these are drafting's counters.
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    server = LiveServer(engine_factory(demo_model_dir(), max_model_len=512, speculative_config=spec),
                        metrics_port=free_port())
    server.wait_loaded()
    try:
        with server.channel() as channel:
            inference, control = pb_grpc.InferenceServiceStub(channel), pb_grpc.ControlServiceStub(channel)
            messages = list(inference.Generate(pb.GenerateRequest(
                text="def add(a, b):\n", sampling=greedy(48, ignore_eos=True)), timeout=60))
            assert sum(len(m.token_ids) for m in messages) == 48
            wait_for_free_blocks(server.engine)
            metrics = scrape(server)
            drafted = metrics[("jetserve_spec_decode_num_draft_tokens_total", ())]
            accepted = metrics[("jetserve_spec_decode_num_accepted_tokens_total", ())]
            per_position = {dict(labels)["position"]: value for (name, labels), value in metrics.items()
                            if name == "jetserve_spec_decode_num_accepted_tokens_per_pos_total"}
            assert drafted > 0 and 0 < accepted <= drafted
            assert set(per_position) == {"0", "1"} and sum(per_position.values()) == accepted
            assert any(len(m.token_ids) > 1 for m in messages)  # accepted drafts arrive together

            stats = inference.GetStats(pb.GetStatsRequest(), timeout=10).speculative
            assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (drafted, accepted)
            assert list(stats.accepted_per_position) == [per_position["0"], per_position["1"]]
            assert control.SetLimits(pb.SetLimitsRequest(num_speculative_tokens=1), timeout=10) \
                .num_speculative_tokens == 1
            try:  # above the k the engine started with: graphs and KV lookahead are sized for that
                control.SetLimits(pb.SetLimitsRequest(num_speculative_tokens=3), timeout=10)
                raise AssertionError("SetLimits accepted a draft length above the started one")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 2" in exc.details()
    finally:
        server.stop()


def test_the_draft_policy_shows_why_drafting_is_on_or_off():
    """GetStats and the metrics carry the adaptive policy's view: per batch bucket the draft
    length it would choose now and the measured step costs it chooses from, and its acceptance
    estimate per draft position. A bucket drafts only where some k could pay. Beside it the draft
    vocabulary's size and coverage (half the demo's ids here; nothing ranked yet: all covered)."""
    from jetserve.server.cli import demo_model_dir

    spec = {"method": "mtp", "num_speculative_tokens": 2, "draft_vocab_size": 4096}
    server = LiveServer(engine_factory(demo_model_dir(), max_model_len=512, speculative_config=spec),
                        metrics_port=free_port())
    server.wait_loaded()
    try:
        with server.channel() as channel:
            inference = pb_grpc.InferenceServiceStub(channel)
            list(inference.Generate(pb.GenerateRequest(text="def add(a, b):\n", sampling=greedy(8)), timeout=60))
            metrics = scrape(server)
            stats = inference.GetStats(pb.GetStatsRequest(), timeout=10).speculative
        buckets = list(stats.buckets)
        assert buckets and all(len(b.step_cost_s) == 3 and b.step_cost_s[0] > 0 for b in buckets)
        for b in buckets:  # T(k) < (k + 1) T(0): k drafts could pay if every one were accepted
            assert b.draft_length == 0 or any(0 < t < (k + 1) * b.step_cost_s[0]
                                              for k, t in enumerate(b.step_cost_s) if k)
        lengths = {dict(labels)["batch_size"] for (name, labels) in metrics
                   if name == "jetserve_spec_decode_draft_length"}
        plain = {dict(labels)["batch_size"] for (name, labels) in metrics
                 if name == "jetserve_spec_decode_step_cost_seconds" and dict(labels)["k"] == "0"}
        assert lengths == plain == {str(b.batch_size) for b in buckets}
        assert len(stats.acceptance_estimate) == 2 and all(0 <= a <= 1 for a in stats.acceptance_estimate)
        assert (stats.draft_vocab_size, stats.draft_vocab_coverage) == (4096, 1.0)
        assert (metrics[("jetserve_spec_decode_draft_vocab_size", ())],
                metrics[("jetserve_spec_decode_draft_vocab_coverage", ())]) == (4096, 1.0)
    finally:
        server.stop()
