"""The compatibility gate: what this device may run, from JetPack/L4T, SoC, Python and CUDA.

The inference service calls `check(probe(sysroot))` at start and runs eager (no CUDA graphs) when
`cuda_graphs_allowed` is false. Facts (the seed): CUDA graphs need JetPack ≥ 5.1; the
tensorrt-llm backend drives TensorRT-LLM ≥ 1.0, which has no Jetson build (Orin's v0.12.0-jetson
branch predates its LLM API), so it runs on data-centre GPUs only; TensorRT Edge-LLM 0.11 runs on
Thor with JetPack 7.0–7.2 and on Orin with JetPack 7.2, and jetserve has no backend for it yet.
The engine and the service need Python ≥ 3.10.
"""

import collections

from jetserve.device.release import version_tuple

OK, WARN, FAIL = "ok", "warn", "fail"
CUDA_GRAPHS_MIN_JETPACK = (5, 1)
SERVICE_MIN_PYTHON = (3, 10)
ORIN, THOR = "nvidia,tegra234", "nvidia,tegra264"

Check = collections.namedtuple("Check", "name status detail")


class Verdict(collections.namedtuple("Verdict", "status cuda_graphs_allowed backends checks facts")):
    """`status` is the worst check: ok, warn (runs, with limits) or fail (this device is too old)."""

    def to_dict(self):
        return {"status": self.status, "cuda_graphs_allowed": self.cuda_graphs_allowed,
                "backends": list(self.backends), "facts": dict(self.facts),
                "checks": [c._asdict() for c in self.checks]}


def check(probe_result):
    """Judge a `jetserve.device.probe.probe()` result; never raises on missing facts."""
    facts = {key: probe_result.get(key) for key in
             ("model", "soc", "l4t", "jetpack", "python", "cuda", "jetson", "nvidia_gpu")}
    if facts["nvidia_gpu"] is None:  # a probe from an older agent: assume what it did
        facts["nvidia_gpu"] = True
    jetpack = version_tuple(facts["jetpack"])
    python = version_tuple(facts["python"])
    soc = facts["soc"] or ""
    checks = []

    if not facts["jetson"] and not facts["nvidia_gpu"]:
        # Nothing to forbid: the gate stays open (cuda_graphs_allowed), the CPU runs its own programs.
        checks.append(Check("gpu", OK, "not a Jetson and no NVIDIA GPU: the engine runs on the CPU "
                            "(decode steps compiled ahead of time; no CUDA graphs here)"))
        graphs = True
    elif not facts["jetson"]:
        checks.append(Check("jetpack", OK, "not a Jetson: the JetPack gate does not apply "
                            "(the engine captures CUDA graphs on this NVIDIA GPU)"))
        graphs = True
    elif jetpack is None:
        checks.append(Check("jetpack", WARN,
                            "L4T %s is not in the JetPack table; cannot confirm JetPack >= 5.1, "
                            "so CUDA graphs stay off" % (facts["l4t"] or "unknown")))
        graphs = False
    elif jetpack < CUDA_GRAPHS_MIN_JETPACK:
        checks.append(Check("jetpack", FAIL,
                            "JetPack %s is too old: CUDA graphs need >= 5.1 (eager only); "
                            "upgrade to JetPack 5.1 or newer" % facts["jetpack"]))
        graphs = False
    else:
        checks.append(Check("jetpack", OK, "JetPack %s (L4T %s): CUDA graphs allowed"
                            % (facts["jetpack"], facts["l4t"])))
        graphs = True

    if python is None or python < SERVICE_MIN_PYTHON:
        checks.append(Check("python", WARN, "Python %s runs the agent only; the service needs >= 3.10"
                            % facts["python"]))
    else:
        checks.append(Check("python", OK, "Python %s runs the agent and the service" % facts["python"]))

    if facts["jetson"] and not facts["cuda"]:
        checks.append(Check("cuda", WARN, "no CUDA toolkit found under /usr/local/cuda"))
    elif facts["cuda"]:
        checks.append(Check("cuda", OK, "CUDA %s" % facts["cuda"]))

    backends = ["torch-eager"]
    if not facts["nvidia_gpu"]:
        backends = ["torch-cpu"]
        checks.append(Check("backends", OK, "torch on the CPU; tensorrt-llm needs a data-centre GPU with "
                            "TensorRT-LLM >= 1.0"))
    elif not facts["jetson"]:
        backends.append("torch-cuda-graphs")
        if facts["cuda"]:
            backends.append("tensorrt-llm")
        checks.append(Check("backends", OK, "torch here; tensorrt-llm where a data-centre GPU has "
                            "TensorRT-LLM >= 1.0 installed"))
    else:
        if graphs:
            backends.append("torch-cuda-graphs")
        detail = ("torch with NVIDIA's PyTorch for this JetPack; no tensorrt-llm on a Jetson (TensorRT-LLM "
                  ">= 1.0 has no Jetson build, and v0.12.0-jetson predates the LLM API that backend drives)")
        if jetpack is not None and ((soc == THOR and (7, 0) <= jetpack[:2] <= (7, 2))
                                    or (soc == ORIN and jetpack[:2] == (7, 2))):
            detail += "; TensorRT Edge-LLM runs on this JetPack, but jetserve has no backend for it yet"
        checks.append(Check("backends", OK, detail))

    worst = FAIL if any(c.status == FAIL for c in checks) else (
        WARN if any(c.status == WARN for c in checks) else OK)
    return Verdict(worst, graphs, tuple(backends), tuple(checks), facts)


def format_table(verdict):
    """The doctor's human-readable report."""
    facts = verdict.facts
    rows = [("device", facts["model"] or "-"), ("soc", facts["soc"] or "-"),
            ("L4T", facts["l4t"] or "-"), ("JetPack", facts["jetpack"] or ("unknown" if facts["jetson"] else "-")),
            ("Python", facts["python"] or "-"), ("CUDA", facts["cuda"] or "-"),
            ("CUDA graphs", "no NVIDIA GPU here (the CPU runs compiled decode steps)" if not facts["nvidia_gpu"]
             else "allowed" if verdict.cuda_graphs_allowed else "not allowed (eager)"),
            ("backends", ", ".join(verdict.backends))]
    lines = ["%-12s %s" % row for row in rows]
    lines.append("")
    lines.extend("[%-4s] %-8s %s" % (c.status.upper(), c.name, c.detail) for c in verdict.checks)
    lines.append("")
    lines.append("verdict: %s" % verdict.status.upper())
    return "\n".join(lines)
