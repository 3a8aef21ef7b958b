"""`jetserve bench ...`: decode latency, chunked prefill, MTP, the bf16 forward check, a profile,
the decode kernels alone.

Imports only the standard library at module level and parses on Python 3.8 (`jetserve.cli`
imports every part's cli module, also on devices without torch). Each benchmark module keeps
its module level stdlib-only too: `add_arguments(parser)` is called here, and `run(args)`
imports torch when the benchmark runs. Each prints JSON and, with --out, writes result.json,
PNG plots and COMMAND.md (the exact command) into that folder.
"""

import importlib
import sys

BENCHMARKS = (
    ("decode", "TPOT by batch size: ours eager/graphs vs transformers vs the bandwidth roofline"),
    ("prefill", "streaming ITL while a long prompt arrives: chunked prefill on/off, TTFT"),
    ("mtp", "MTP drafting: tok/s vs no drafting on held-out prompts, acceptance, step-time ratios"),
    ("forward", "greedy tokens and logits of the engine vs transformers on one device"),
    ("profile", "where the time of a batch-1 decode step goes (torch.profiler)"),
    ("prefill_profile", "where the time of a chunked-prefill step goes, by its chunk's depth (torch.profiler)"),
    ("kernels", "the decode kernels alone: skinny matmul vs cuBLAS bandwidth, split-context attention"),
    ("serve", "the service under load over gRPC: TTFT, ITL, TPOT and tok/s next to the engine's own step"),
    ("fleet", "simulated devices over MQTT against real controllers: lost messages, registry lag, offline detection"),
    ("quant", "weight-only INT8/INT4 decode vs bf16, and projected ms/token on the Jetson boards"),
    ("startup", "`jetserve serve` from launch to SERVING and the first answer, fresh and warm caches, by phase"),
    ("soak", "minutes to hours of mixed load on a live server: RSS, KV blocks, ITL and TTFT over time, judged on drift"),
    ("perplexity", "quantization quality: held-out perplexity and MTP draft agreement, bf16 vs INT8 vs INT4"),
)


def register(subparsers):
    bench = subparsers.add_parser("bench", help="benchmarks (print JSON, draw PNG plots)",
                                  description="Benchmarks: each prints JSON and, with --out, writes "
                                              "result.json, PNG plots and COMMAND.md.")
    bench.set_defaults(func=lambda args: bench.print_help() or 2)
    actions = bench.add_subparsers(dest="bench_action", metavar="BENCHMARK")
    for name, help_text in BENCHMARKS:
        p = actions.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--out", help="write result.json, plots and COMMAND.md into this folder")
        try:
            module = importlib.import_module("jetserve.bench." + name)
        except ImportError as exc:  # not written yet, or it imports something missing here
            p.set_defaults(func=_unavailable(name, exc))
            continue
        module.add_arguments(p)
        p.set_defaults(func=_run(module))


def _run(module):
    def run(args):
        module.run(args)
        return 0
    return run


def _unavailable(name, exc):
    def run(args):
        print("jetserve bench %s: unavailable here (%s)" % (name, exc), file=sys.stderr)
        return 2
    return run
