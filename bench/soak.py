"""`jetserve bench soak`: minutes to hours of mixed load against a live `jetserve serve`, sampled
once a second, judged on drift.

The server is started as `jetserve serve` (the bundled demo model on the CPU unless told
otherwise) with its engine core in its own process. `--concurrency` workers on one event loop
each pick their next request from a seeded mix and pause a little between them (the load is
bounded, so a shared machine keeps up): gRPC streams (token ids or text), OpenAI completions and
chat streams (the `openai` SDK), n > 1 with logprobs on both, cancels after a few tokens,
deadlines that expire mid-stream, stalled readers (the first message read, then seconds of
silence). On a clock of their own (so every tenth of the run holds as many): a prompt of half
to nearly all of max_model_len every `--long-every` seconds, and every `--drain-every` seconds a
drain and resume through Control; what is refused while it drains must say UNAVAILABLE (503 over
HTTP), and any other status is counted as unexpected.

Once a second: the RSS of the server and of its engine core process (/proc), KV blocks in use,
running and waiting (GetStats), and the ITL and TTFT the clients saw over the last second(s)
(p50/p99; plain gRPC and OpenAI streams only: a cancelled, stalled or long-prompt request's
latency is its own doing). The load ends with `--idle` seconds of nothing.

Verdict (exit code 1 on fail), the measured period being the load after the warm-up (which
also waits out the engine's background compile of its CPU decode steps, up to half the load):
- RSS: the median of the measured period's last tenth within +5% (`--rss-tolerance`) of the
  median of its first tenth, for both processes (medians: a long prompt's transient peak is not
  a leak, a leak moves the median);
- KV: no block in use, and nothing running or waiting, at the end of the idle period;
- latency: the p99 of the last tenth within 1.2x (`--p99-ratio`) of the first tenth's, ITL and
  TTFT, each tenth's p99 taken as the median of its slices' p99 (5 s slices, 10 s for the fewer
  TTFTs: a neighbour's burst on a shared machine moves a slice, a slowdown of the service moves
  them all). A "tenth" spans at least one period of the long-prompt and the drain clocks (at
  most half the measured period): a long prompt delays the TTFTs queued behind it, so windows
  holding unequal numbers of them would differ by construction, not by drift;
- no unexpected status, and the server alive to the end.
"""

from __future__ import annotations

import os
import random
import shlex
import subprocess
import sys
import time

SAMPLE_S = 1.0
SLICE_S = {"itl": 5.0, "ttft": 10.0}  # the latency verdict's slices (see the docstring): TTFTs are fewer
TTFT_WINDOW_S = 5.0  # TTFT samples are fewer than ITL's: the per-second series looks back this far
MAX_MINUTES = 24 * 60
MAX_CONCURRENCY = 64
# The mix: kind → weight.
MIX = {"grpc": 30, "openai": 15, "chat": 5, "grpc_n": 8, "openai_n": 5, "cancel": 10, "deadline": 8,
       "stalled": 5}
LATENCY_KINDS = ("grpc", "openai", "chat")
WORDS = ("def", "return", "self", "import", "class", "for", "in", "if", "else", "None", "value", "path", "os",
         "list", "dict", "args", "kwargs", "print", "raise", "while", "yield", "lambda", "try", "except")


def add_arguments(p):
    p.add_argument("--minutes", type=float, default=10.0, help="minutes of load, warm-up included (default 10)")
    p.add_argument("--model", help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", type=int, default=4, help="workers sending requests (default 4)")
    p.add_argument("--pause", type=float, default=0.3, help="most seconds a worker rests between requests")
    p.add_argument("--warmup", type=float, help="seconds of load before the measured period "
                                                "(default: a tenth of the load, 30 s to 5 min)")
    p.add_argument("--idle", type=float, default=15.0, help="seconds of no load at the end (default 15)")
    p.add_argument("--drain-every", type=float, default=60.0, help="seconds between Control drain/resume cycles")
    p.add_argument("--long-every", type=float, default=20.0, help="seconds between long prompts")
    p.add_argument("--max-tokens", type=int, default=48, help="most tokens a plain request asks for")
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--p99-ratio", type=float, default=1.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-flags", default="", help="extra `jetserve serve` flags")


def run(args):
    import asyncio
    import tempfile

    from jetserve.bench.common import free_port, stop_server, wait_serving, write_results

    if not 0 < args.minutes <= MAX_MINUTES or not 1 <= args.concurrency <= MAX_CONCURRENCY:
        raise SystemExit("jetserve bench soak: --minutes 0..%d, --concurrency 1..%d" % (MAX_MINUTES, MAX_CONCURRENCY))
    if not 0 <= args.idle <= 600 or min(args.drain_every, args.long_every) <= 0 or not 1 <= args.max_tokens <= 1024:
        raise SystemExit("jetserve bench soak: --idle 0..600 s, --drain-every and --long-every > 0, "
                         "--max-tokens 1..1024")
    load_s = args.minutes * 60
    warmup = args.warmup if args.warmup is not None else min(300.0, max(30.0, load_s / 10))
    if not 0 <= warmup < load_s:
        raise SystemExit("jetserve bench soak: --warmup must be shorter than the load")
    port, openai_port = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="jetserve-soak-") as tmp:
        log_path = os.path.join(args.out or tmp, "server.log")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        command = [sys.executable, "-m", "jetserve.cli", "serve", "--device", args.device, "--port", str(port),
                   "--openai-port", str(openai_port), "--metrics-port", "0", "--log-level", "INFO",
                   *(["--model", args.model] if args.model else []), *shlex.split(args.serve_flags)]
        with open(log_path, "wb") as log:
            server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd="/",
                                      env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            target = "127.0.0.1:%d" % port
            wait_serving(target, server, time.monotonic() + 600)
            soak = Soak(args, target, openai_port, server, log_path, load_s, warmup)
            asyncio.run(soak.run())
            alive = server.poll() is None
        finally:
            stop_server(server)
    result = soak.result(command, alive)
    write_results(args.out, result, {"soak": _plot(result)} if args.out else {})
    verdict = result["verdict"]
    print("jetserve bench soak: %s (%s)" % ("PASS" if verdict["passed"] else "FAIL", "; ".join(verdict["why"])),
          file=sys.stderr)
    if not verdict["passed"]:
        raise SystemExit(1)
    return result


def _progress(text):
    print("[bench soak %s] %s" % (time.strftime("%H:%M:%S"), text), file=sys.stderr, flush=True)


class Soak:
    """The load, the sampler and what they saw, on one event loop."""

    def __init__(self, args, target, openai_port, server, log_path, load_s, warmup):
        self.args, self.target, self.openai_port, self.server, self.log_path = args, target, openai_port, server, log_path
        self.load_s, self.warmup = load_s, warmup
        self.rng = random.Random(args.seed)
        self.itl, self.ttft, self.long_ttft = [], [], []  # (monotonic time, seconds)
        self.outcomes = {}  # kind → {outcome: count}
        self.unexpected = []  # the first few, verbatim
        self.samples = []
        self.drains = []  # (drain called, resume returned)
        self.draining_since = None
        self.tokens = 0
        self.compile = {"started": None, "ended": None}

    # -- the run --------------------------------------------------------------------------------

    async def run(self):
        import asyncio

        import grpc
        import openai

        from jetserve.v1 import inference_pb2 as pb
        from jetserve.v1 import inference_pb2_grpc as pb_grpc

        self.pb = pb
        async with grpc.aio.insecure_channel(self.target) as channel:
            self.stub = pb_grpc.InferenceServiceStub(channel)
            self.control = pb_grpc.ControlServiceStub(channel)
            info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            self.model, self.vocab, self.max_model_len = info.model, info.vocab_size, info.max_model_len
            self.has_chat = info.has_chat_template
            self.openai = openai.AsyncOpenAI(base_url="http://127.0.0.1:%d/v1" % self.openai_port, api_key="soak",
                                             max_retries=0, timeout=120)
            self.start = time.monotonic()
            self.load_end = self.start + self.load_s
            self.end = float("inf")  # the idle period begins when the last request is over
            _progress("serving %s; %d workers for %.0f s (warm-up %.0f s), then %.0f s idle" % (
                self.model, self.args.concurrency, self.load_s, self.warmup, self.args.idle))
            sampler = asyncio.create_task(self._sampler())
            await asyncio.gather(self._drainer(), self._every(self.args.long_every, "long", random.Random(self.rng.random())),
                                 *(self._every(self.args.pause, None, random.Random(self.rng.random()))
                                   for _ in range(self.args.concurrency)))
            self.idle_from = time.monotonic() - self.start
            self.end = time.monotonic() + self.args.idle
            await sampler
            await self.openai.close()

    async def _every(self, period, kind, rng):
        """A worker: a request of `kind` (None: one drawn from MIX) after each rest of up to
        `period` seconds (a clock's worker: every `period` seconds), until the load ends."""
        import asyncio

        kinds, weights = zip(*MIX.items())
        tick = time.monotonic() - period / 2  # a clock's first request half a period in: between drains
        while True:
            if kind:
                tick += period
                await asyncio.sleep(max(0.0, tick - time.monotonic()))
            if time.monotonic() >= self.load_end:
                return
            await self._one(kind or rng.choices(kinds, weights)[0], rng)
            if not kind:
                await asyncio.sleep(rng.uniform(0, period))

    async def _one(self, kind, rng):
        if kind == "chat" and not self.has_chat:
            kind = "openai"
        started = time.monotonic()
        try:
            outcome = await getattr(self, "_" + kind)(rng)
        except Exception as exc:  # noqa: BLE001 - every status is sorted: expected, or counted as unexpected
            outcome = self._classify(kind, exc, started)
        counts = self.outcomes.setdefault(kind, {})
        counts[outcome] = counts.get(outcome, 0) + 1

    def _classify(self, kind, exc, started):
        import grpc
        import openai

        code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
        status = getattr(exc, "status_code", None) if isinstance(exc, openai.APIStatusError) else None
        if (code == grpc.StatusCode.UNAVAILABLE or status == 503) and self._in_drain(started):
            return "refused while draining"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and kind == "deadline":
            return "deadline exceeded"
        if len(self.unexpected) < 20:
            self.unexpected.append("%s at %.0f s: %s: %s" % (kind, started - self.start, type(exc).__name__,
                                                             str(exc).replace("\n", " ")[:300]))
        return "unexpected: %s" % (code.name if code else status or type(exc).__name__)

    def _in_drain(self, t):
        """Whether a request that began at `t` may have met a drain (up to a second either side)."""
        if self.draining_since is not None and t >= self.draining_since - 1:
            return True
        return any(begin - 1 <= t <= end + 1 for begin, end in self.drains)

    # -- the requests ---------------------------------------------------------------------------

    def _prompt(self, rng, tokens=None):
        if tokens:
            return self.pb.TokenIds(ids=[rng.randrange(self.vocab) for _ in range(tokens)])
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) + " %d" % rng.randrange(10**6)

    def _sampling(self, rng, **kw):
        return self.pb.SamplingOptions(temperature=0.8, top_p=0.95, seed=rng.randrange(2**31),
                                       max_tokens=rng.randint(4, self.args.max_tokens), **kw)

    def _request(self, rng, tokens=None, **kw):
        pb = self.pb
        if tokens or rng.random() < 0.5:
            return pb.GenerateRequest(token_ids=self._prompt(rng, tokens or rng.randint(8, 200)),
                                      sampling=self._sampling(rng, **kw))
        return pb.GenerateRequest(text=self._prompt(rng), sampling=self._sampling(rng, **kw))

    async def _read(self, call, latency=True, stop_after=None):
        """Read a gRPC stream to its end (or `stop_after` token messages); TTFT and ITL recorded."""
        import grpc

        start = last = time.monotonic()
        messages = 0
        while True:
            reply = await call.read()
            if reply is grpc.aio.EOF:
                return messages
            if reply.token_ids:
                now = time.monotonic()
                self.tokens += len(reply.token_ids)
                if latency:
                    (self.itl if messages else self.ttft).append((now, now - (last if messages else start)))
                last, messages = now, messages + 1
                if stop_after is not None and messages >= stop_after:
                    return messages

    async def _grpc(self, rng):
        await self._read(self.stub.Generate(self._request(rng)))
        return "ok"

    async def _grpc_n(self, rng):
        n = rng.randint(2, 4)
        await self._read(self.stub.Generate(self._request(rng, n=n, logprobs=rng.randint(0, 3))), latency=False)
        return "ok"

    async def _cancel(self, rng):
        call = self.stub.Generate(self._request(rng, ignore_eos=True))
        await self._read(call, latency=False, stop_after=rng.randint(1, 3))
        call.cancel()
        return "cancelled"

    async def _deadline(self, rng):
        request = self._request(rng, ignore_eos=True)
        request.sampling.max_tokens = 400
        await self._read(self.stub.Generate(request, timeout=rng.uniform(0.05, 0.5)), latency=False)
        return "ok (before its deadline)"

    async def _stalled(self, rng):
        """A reader that stops reading for seconds, then reads the rest: the server must hold,
        not buffer without end or drop the stream."""
        import asyncio

        request = self._request(rng, ignore_eos=True)
        request.sampling.max_tokens = 200
        call = self.stub.Generate(request)
        await self._read(call, latency=False, stop_after=1)
        await asyncio.sleep(rng.uniform(2, 5))
        await self._read(call, latency=False)
        return "ok"

    async def _long(self, rng):
        start = time.monotonic()
        request = self._request(rng, tokens=rng.randint(self.max_model_len // 2, self.max_model_len - 64))
        request.sampling.max_tokens = 8
        call = self.stub.Generate(request)
        await self._read(call, latency=False, stop_after=1)
        self.long_ttft.append((time.monotonic(), time.monotonic() - start))
        await self._read(call, latency=False)
        return "ok"

    async def _openai(self, rng, n=1, logprobs=None, latency=True):
        kw = {"logprobs": logprobs} if logprobs is not None else {}
        stream = await self.openai.completions.create(
            model=self.model, prompt=self._prompt(rng), max_tokens=rng.randint(4, self.args.max_tokens), n=n,
            temperature=0.8, seed=rng.randrange(2**31), stream=True, **kw)
        await self._chunks(stream, latency, lambda c: c.choices and c.choices[0].text)
        return "ok"

    async def _openai_n(self, rng):
        return await self._openai(rng, n=rng.randint(2, 3), logprobs=rng.randint(0, 3), latency=False)

    async def _chat(self, rng):
        stream = await self.openai.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": self._prompt(rng)}],
            max_tokens=rng.randint(4, self.args.max_tokens), temperature=0.8, stream=True)
        await self._chunks(stream, True, lambda c: c.choices and c.choices[0].delta.content)
        return "ok"

    async def _chunks(self, stream, latency, has_text):
        start = last = time.monotonic()
        messages = 0
        async for chunk in stream:
            if has_text(chunk):
                now = time.monotonic()
                self.tokens += 1  # a chunk: one engine step's text for this stream (tokens not counted here)
                if latency:
                    (self.itl if messages else self.ttft).append((now, now - (last if messages else start)))
                last, messages = now, messages + 1

    async def _drainer(self):
        import asyncio

        pb = self.pb
        tick = time.monotonic()
        while True:
            tick += self.args.drain_every
            if tick > self.load_end - 5:
                return
            await asyncio.sleep(max(0.0, tick - time.monotonic()))
            begin = self.draining_since = time.monotonic()
            await self.control.Drain(pb.DrainRequest(), timeout=30)
            await asyncio.sleep(1.0)
            await self.control.Resume(pb.ResumeRequest(), timeout=30)
            self.drains.append((begin, time.monotonic()))
            self.draining_since = None

    # -- the sampler ----------------------------------------------------------------------------

    async def _sampler(self):
        import asyncio

        import grpc

        pb = self.pb
        tick = self.start
        while tick < self.end:
            tick += SAMPLE_S
            await asyncio.sleep(max(0.0, tick - time.monotonic()))
            now = time.monotonic()
            try:
                stats = await self.stub.GetStats(pb.GetStatsRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                stats = None
                self.unexpected.append("GetStats at %.0f s: %s" % (now - self.start, exc.code().name))
            server, core = _rss(self.server.pid)
            itl = [v for t, v in _since(self.itl, now - SAMPLE_S)]
            ttft = [v for t, v in _since(self.ttft, now - TTFT_WINDOW_S)]
            self.samples.append({
                "t": round(now - self.start, 2), "rss_server_mb": server, "rss_core_mb": core,
                "kv_blocks_used": stats.kv_blocks_used if stats else None,
                "running": stats.num_running if stats else None, "waiting": stats.num_waiting if stats else None,
                "itl_ms_p50": _pct(itl, 50), "itl_ms_p99": _pct(itl, 99), "itl_n": len(itl),
                "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": _pct(ttft, 99),
                "tokens": self.tokens, "load_avg_1m": os.getloadavg()[0]})
            self._watch_compile(now)
            if len(self.samples) % 60 == 0:
                s = self.samples[-1]
                _progress("%.0f s: RSS %.1f / %.1f MB, KV %s, ITL p99 %s ms, load %.1f" % (
                    s["t"], server or 0, core or 0, s["kv_blocks_used"], s["itl_ms_p99"], s["load_avg_1m"]))

    def _watch_compile(self, now):
        """When the engine's background compile of its CPU decode steps began and ended (its log)."""
        if self.compile["ended"] is not None:
            return
        with open(self.log_path, errors="replace") as f:
            text = f.read()
        if self.compile["started"] is None and "in the background (once per model" in text:
            self.compile["started"] = round(now - self.start, 1)
        if "compiled in the background" in text or "background compile of" in text:
            self.compile["ended"] = round(now - self.start, 1)

    # -- the verdict ----------------------------------------------------------------------------

    def result(self, command, alive):
        ended = self.compile["ended"]
        waits = self.compile["started"] is not None and ended is None
        warmup = min(max(self.warmup, ended or 0.0) if not waits else self.load_s / 2, self.load_s / 2)
        verdict = judge(self.samples, self.itl, self.ttft, self.start, warmup, self.load_s, self.idle_from, self.args)
        if ended is not None and ended > warmup:
            verdict["why"].append("the background compile ended at %.0f s, after the warm-up" % ended)
        if self.unexpected:
            verdict["passed"] = False
            verdict["why"].append("%d unexpected statuses" % len(self.unexpected))
        if not alive:
            verdict["passed"] = False
            verdict["why"].append("the server exited during the run")
        return {"bench": "soak", "model": self.model, "command": command[3:], "minutes": self.args.minutes,
                "concurrency": self.args.concurrency, "warmup_s": round(warmup, 1), "idle_s": self.args.idle,
                "idle_from_s": round(self.idle_from, 1),
                "background_compile_s": self.compile, "drains": len(self.drains), "outcomes": self.outcomes,
                "unexpected": self.unexpected, "long_prompt_ttft_ms": _pcts([v for _, v in self.long_ttft]),
                "verdict": verdict, "samples": self.samples, "env": _environment()}


def judge(samples, itl, ttft, start, warmup, load_s, idle_from, args):
    """The pass/fail of the module's docstring, from the samples and the raw latencies."""
    from jetserve.bench.common import median

    begin, end = warmup, load_s
    tenth = min(max((end - begin) / 10, args.long_every, args.drain_every), (end - begin) / 2)
    first = [s for s in samples if begin <= s["t"] < begin + tenth]
    last = [s for s in samples if end - tenth <= s["t"] < end]
    out, why = {"measured_s": [round(begin, 1), round(end, 1)], "tenth_s": round(tenth, 1)}, []
    passed = True
    for proc in ("server", "core"):
        key = "rss_%s_mb" % proc
        a = median([s[key] for s in first if s[key]])
        b = median([s[key] for s in last if s[key]])
        growth = b / a - 1 if a == a and b == b and a else float("nan")
        ok = growth <= args.rss_tolerance
        out[key] = {"first_tenth_median": a, "last_tenth_median": b, "growth": round(growth, 4),
                    "max_measured": max((s[key] or 0 for s in samples if begin <= s["t"] < end), default=None),
                    "passed": ok}
        passed &= ok
        why.append("%s RSS %+.1f%%" % (proc, 100 * growth))
    idle = [s for s in samples if s["t"] >= idle_from]
    final = idle[-1] if idle else None
    kv_ok = bool(final) and final["kv_blocks_used"] == 0 and final["running"] == 0 and final["waiting"] == 0
    out["kv_at_idle"] = {"blocks_used": final and final["kv_blocks_used"], "running": final and final["running"],
                         "waiting": final and final["waiting"], "max_during_load": max(
                             (s["kv_blocks_used"] or 0 for s in samples if s["t"] < end), default=None),
                         "passed": kv_ok}
    passed &= kv_ok
    why.append("KV blocks at idle %s" % (final and final["kv_blocks_used"]))
    for name, values in (("itl", itl), ("ttft", ttft)):
        rel = [(t - start, v) for t, v in values]
        a, b = _slice_p99(rel, begin, begin + tenth, SLICE_S[name]), _slice_p99(rel, end - tenth, end, SLICE_S[name])
        ratio = b / a if a and a == a and b == b else float("nan")
        ok = ratio <= args.p99_ratio
        out[name + "_p99_ms"] = {"first_tenth": a, "last_tenth": b, "ratio": round(ratio, 3), "passed": ok,
                                 "first_tenth_pooled": _pct([v for t, v in rel if begin <= t < begin + tenth], 99),
                                 "last_tenth_pooled": _pct([v for t, v in rel if end - tenth <= t < end], 99)}
        passed &= ok
        why.append("%s p99 x%.2f" % (name.upper(), ratio))
    out.update(passed=bool(passed), why=why, criteria={"rss_tolerance": args.rss_tolerance,
                                                       "p99_ratio": args.p99_ratio, "slice_s": SLICE_S})
    return out


def _slice_p99(values, begin, end, width):
    """The median over [begin, end)'s slices (`width` seconds, or the whole span if shorter) of
    each slice's p99 (ms); nan (a fail: nothing to tell by) with no slice of at least 3 samples."""
    from jetserve.bench.common import median

    width, slices = min(width, end - begin), {}
    for t, v in values:
        if begin <= t < end:
            slices.setdefault(int((t - begin) // width), []).append(v)
    return median([_pct(v, 99) for v in slices.values() if len(v) >= 3])


def _since(values, t):
    """The (time, value) pairs after `t` (appended in time order: read from the end)."""
    i = len(values)
    while i and values[i - 1][0] > t:
        i -= 1
    return values[i:]


def _pct(values, q):
    from jetserve.bench.common import percentile

    return round(percentile(values, q) * 1e3, 3) if values else None


def _pcts(values):
    return {"p50": _pct(values, 50), "p99": _pct(values, 99), "n": len(values)}


def _rss(pid):
    """RSS (MB) of the server and of its engine core (its longest-lived child process), from /proc."""
    def rss(p):
        try:
            with open("/proc/%d/status" % p) as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return round(int(line.split()[1]) / 1024, 2)
        except OSError:
            return None
        return None

    children = []
    try:
        for task in os.listdir("/proc/%d/task" % pid):
            with open("/proc/%d/task/%s/children" % (pid, task)) as f:
                children += [int(c) for c in f.read().split()]
    except OSError:
        pass
    core = min(children, default=None)  # pids grow: the first child is the engine core (a compile comes later)
    return rss(pid), rss(core) if core else None


def _environment():
    import platform

    return {"python": platform.python_version(), "cpus": len(os.sched_getaffinity(0)),
            "load_avg_1m_at_end": os.getloadavg()[0]}


def _plot(result):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    t = [x["t"] / 60 for x in s]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), sharex=True)
    (rss, kv), (itl, ttft) = axes
    rss.plot(t, [x["rss_server_mb"] for x in s], label="server")
    rss.plot(t, [x["rss_core_mb"] for x in s], label="engine core")
    rss.set(ylabel="RSS (MB)", title="RSS")
    kv.plot(t, [x["kv_blocks_used"] for x in s], color="C2", lw=0.8)
    kv.set(ylabel="blocks", title="KV blocks in use")
    itl.plot(t, [x["itl_ms_p50"] for x in s], lw=0.6, label="p50, last second")
    itl.plot(t, [x["itl_ms_p99"] for x in s], lw=0.6, label="p99, last second")
    itl.set(ylabel="ms", title="ITL (plain streams)", xlabel="minutes")
    ttft.plot(t, [x["ttft_ms_p50"] for x in s], lw=0.6, label="p50, last %g s" % TTFT_WINDOW_S)
    ttft.plot(t, [x["ttft_ms_p99"] for x in s], lw=0.6, label="p99, last %g s" % TTFT_WINDOW_S)
    ttft.set(ylabel="ms", title="TTFT (plain streams)", xlabel="minutes")
    begin, end = result["verdict"]["measured_s"]
    for ax in axes.flat:
        ax.axvspan(0, begin / 60, color="0.9", label="warm-up")
        ax.axvspan(result["idle_from_s"] / 60, t[-1] if t else end / 60, color="0.8", label="idle")
        ax.legend(fontsize=7)
    v = result["verdict"]
    fig.suptitle("jetserve bench soak: %s, %g min, %d workers: %s (%s)" % (
        result["model"], result["minutes"], result["concurrency"], "PASS" if v["passed"] else "FAIL",
        "; ".join(v["why"])), fontsize=9)
    fig.tight_layout()
    return fig


if __name__ == "__main__":  # pragma: no cover
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--out")
    run(parser.parse_args())
