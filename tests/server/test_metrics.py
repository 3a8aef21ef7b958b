"""The metrics as Prometheus and Grafana see them: promtool's lint, the OpenMetrics form a modern
scraper negotiates, the README's names, the dashboard's queries, and the per-request series."""

import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from tests.server.conftest import greedy, wait_for_free_blocks
from tests.tools import require_tool
from jetserve.v1 import inference_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "jetserve.json"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def exposition(live, accept=None):
    request = urllib.request.Request("http://127.0.0.1:%d/metrics" % live.server.metrics_port,
                                     headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


def samples(live):
    """{(name, labels without model_name): value}"""
    _, text = exposition(live)
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in parse_text(text) for s in family.samples}


def names(families):
    """Every name a query may use: sample names, and a counter's family with _total even before
    it has a sample (per-position counters appear with the first draft)."""
    out = set()
    for family in families:
        out.update((family.name, family.name + "_total") if family.type == "counter" else (family.name,))
        out.update(sample.name for sample in family.samples)
    return out


def generate(stubs, text="The kiosk", max_tokens=5):
    inference, _ = stubs
    return list(inference.Generate(pb.GenerateRequest(text=text, sampling=greedy(max_tokens, ignore_eos=True))))


def test_promtool_finds_nothing_to_complain_about(stubs, live):
    generate(stubs)
    promtool = require_tool("promtool", how="apt-get install prometheus")
    _, text = exposition(live)
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), \
        result.stdout + result.stderr


def test_every_series_names_the_model(stubs, live):
    generate(stubs)
    _, text = exposition(live)
    families = list(parse_text(text))
    assert families
    for family in families:
        for sample in family.samples:
            assert sample.labels.get("model_name") == live.engine.model_info.served_model_name, sample


def test_openmetrics_exposition_has_the_readme_names(stubs, live):
    """A scraper that negotiates OpenMetrics (Prometheus 2.42 does) gets the names README.md and docs/service.md document."""
    generate(stubs)
    content_type, text = exposition(live, OPENMETRICS)
    assert content_type.startswith("application/openmetrics-text")
    exported = names(parse_openmetrics(text))
    pages = (ROOT / "README.md").read_text() + (ROOT / "docs" / "service.md").read_text()
    documented = {name for name in re.findall(r"`(jetserve_[a-z0-9_]+)", pages)
                  if not name.startswith("jetserve_fleet_")}  # the fleet controller's own, not the service's
    assert len(documented) >= 20
    assert documented <= exported, sorted(documented - exported)


def test_every_dashboard_query_names_an_exported_metric(stubs, live):
    generate(stubs)
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries += [variable["definition"] for variable in dashboard["templating"]["list"] if "definition" in variable]
    assert len(queries) >= 20
    exported = names(parse_text(exposition(live)[1]))
    for query in queries:
        used = set(re.findall(r"\bjetserve_[a-z0-9_]+\b", query))
        assert used, query
        assert used <= exported, (query, sorted(used - exported))


def test_a_request_moves_its_histograms(stubs, live):
    before = samples(live)
    messages = generate(stubs, "robot arm", max_tokens=6)
    wait_for_free_blocks(live.engine)
    after = samples(live)

    def moved(name):
        return after[(name, ())] - before.get((name, ()), 0)

    prompt_tokens = messages[-1].usage.prompt_tokens
    assert moved("jetserve_request_prompt_tokens_sum") == prompt_tokens
    assert moved("jetserve_request_generation_tokens_sum") == 6
    assert moved("jetserve_request_params_max_tokens_sum") == 6
    assert moved("jetserve_request_params_n_sum") == 1
    for phase in ("queue", "prefill", "decode", "inference"):
        assert moved("jetserve_request_%s_time_seconds_count" % phase) == 1, phase
    # queue + inference is the request's time inside the engine: no longer than end to end
    inside = moved("jetserve_request_queue_time_seconds_sum") + moved("jetserve_request_inference_time_seconds_sum")
    assert 0 < inside <= moved("jetserve_e2e_request_latency_seconds_sum")
    # one per delivered delta after the first (a slow reader gets steps merged into one delta)
    assert moved("jetserve_inter_token_latency_seconds_count") == len(messages) - 1 <= 5


def test_each_engine_step_records_its_tokens(stubs, live):
    """vLLM's iteration_tokens: one prefill step of the whole prompt, then one token a step."""
    wait_for_free_blocks(live.engine)
    before = samples(live)
    messages = generate(stubs, "robot arm", max_tokens=6)
    wait_for_free_blocks(live.engine)
    after = samples(live)

    def moved(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0)

    prompt_tokens = messages[-1].usage.prompt_tokens
    assert moved("jetserve_iteration_tokens_count") == 6
    assert moved("jetserve_iteration_tokens_sum") == prompt_tokens + 5
    assert moved("jetserve_iteration_tokens_bucket", (("le", "1.0"),)) == 5


def test_a_cancelled_stream_counts_as_an_abort(stubs, live):
    inference, _ = stubs
    key = ("jetserve_request_success_total", (("finished_reason", "abort"),))
    before = samples(live)[key]
    stream = inference.Generate(pb.GenerateRequest(text="hi", sampling=greedy(400, ignore_eos=True)))
    next(stream)
    stream.cancel()
    deadline = time.monotonic() + 10
    while samples(live)[key] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert samples(live)[key] == before + 1
    try:
        next(stream)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.CANCELLED
