"""`jetserve bench fleet`: thousands of simulated devices against a real broker, real controllers
and a real registry (SQLite, or PostgreSQL behind several `$share` replicas), all on loopback.

One asyncio process holds every device's MQTT connection (aiomqtt), each with its own broker
account, made as deploy/ makes them (mosquitto_passwd, the shipped ACL and broker settings). A
device publishes a birth after connecting with its Will (neither retained, as Sparkplug has it), a health document every `--interval` seconds (a
real agent's document, its (epoch, n) advanced) and now and then a thermal alert. Near the end a
share of the devices goes away: half killed (the connection closes, the broker sends the Will),
half cut off (a relay in front of them stops forwarding, as a pulled cable does: only keepalive
and the controller's silence rule can tell). Measured, from the registry polled every
POLL_S: messages the broker acknowledged but the registry never counted (lost), the lag from
publishing to the registry counting it (p50/p99; it includes up to POLL_S of polling), and how
long each device that went away took to show offline. From the controllers' own /metrics
(scraped every second): their lag from the device's timestamp to the commit, messages per
transaction, the deepest their queues got, and retried transactions. The 1-minute load average
before and after each run is kept beside it: the machine may be shared. Everything is bounded:
devices, time, and the drain at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import sys
import time

POLL_S = 0.2
SCRAPE_S = 1.0
DRAIN_S = 60.0  # after the devices stop, how long the registry gets to count what was acknowledged
SOAK_MAX_MINUTES = 24 * 60
RSS_WARMUP = 0.3  # a controller's first 30% of its life (its backlog replayed, caches filled) is its warm-up
FLEET = "load"


def add_arguments(parser) -> None:
    parser.add_argument("--devices", default="2000",
                        help="simulated devices; a list (1000,2000,4000) runs each in turn and stops at the "
                             "first that misses a goal: the ceiling")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between a device's health reports")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds every device reports")
    parser.add_argument("--keepalive", type=int, default=12, help="devices' MQTT keepalive (s)")
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--postgres", metavar="URL", default=os.environ.get("JETSERVE_TEST_POSTGRES"),
                        help="a PostgreSQL server where a database may be created for the run")
    parser.add_argument("--replicas", type=int, default=1, help="controllers sharing the stream ($share)")
    parser.add_argument("--offline", type=float, default=0.05, help="share of devices that go away near the end")
    parser.add_argument("--alert-every", type=int, default=12, help="a thermal alert every N health reports")
    parser.add_argument("--ramp", type=float, default=20.0, help="seconds over which the devices connect")
    parser.add_argument("--lag-goal", type=float, default=1.0, help="p99 lag a run must stay under (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--priority", action="store_true",
                        help="run the simulator, broker and controllers at nice -10, and their session's scheduler "
                             "group too where the kernel groups by session (autogroup; root): on a machine shared "
                             "with other work, measure the fleet's software rather than the neighbours")
    parser.add_argument("--soak", type=float, metavar="MINUTES",
                        help="a soak instead of a load run: the devices report for MINUTES (up to a day, the "
                             "broker keeping its sessions on disk as deploy/ has it) while the broker is restarted "
                             "and the controller killed (-9) every --fault-every seconds; its verdict is nothing "
                             "lost and the controllers' RSS flat (lag is reported, faults make it)")
    parser.add_argument("--fault-every", type=float, metavar="SECONDS",
                        help="with --soak: seconds between broker restarts, and between controller kills (half a "
                             "period apart); default 600, or a third of a shorter soak")
    parser.add_argument("--rss-tolerance", type=float, default=0.05,
                        help="with --soak: how much a controller's RSS may grow over its life after its warm-up")


def run(args) -> dict:
    from jetserve.bench.common import write_results

    counts = [int(n) for n in str(args.devices).split(",")]
    for n in counts:
        if not 1 <= n <= 20000:
            raise SystemExit("jetserve bench fleet: --devices must be 1..20000, got %d" % n)
    if args.backend == "postgresql" and not args.postgres:
        raise SystemExit("jetserve bench fleet: --backend postgresql needs --postgres URL (or $JETSERVE_TEST_POSTGRES)")
    if args.soak is not None:
        if not 0 < args.soak <= SOAK_MAX_MINUTES:
            raise SystemExit("jetserve bench fleet: --soak 0..%d minutes" % SOAK_MAX_MINUTES)
        args.duration = args.soak * 60
        args.fault_every = args.fault_every or min(600.0, args.duration / 3)
        if not 10 <= args.fault_every <= args.duration:
            raise SystemExit("jetserve bench fleet: --fault-every 10 s .. the soak's length")
    if not 1 <= args.replicas <= 8 or (args.duration > 1800 and args.soak is None) or args.interval <= 0:
        raise SystemExit("jetserve bench fleet: --replicas 1..8, --duration up to 1800 s (longer: --soak), "
                         "--interval > 0")
    _raise_file_limit()
    if args.priority:
        _prioritize()
    runs = []
    for n in counts:
        result = run_once(args, n)
        runs.append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("series", "soak")}), file=sys.stderr, flush=True)
        if not result["goals_met"]:
            break
    passed = [r["devices"] for r in runs if r["goals_met"]]
    summary = {"bench": "fleet soak" if args.soak else "fleet", "backend": args.backend, "replicas": args.replicas, "interval_s": args.interval,
               "duration_s": args.duration, "keepalive_s": args.keepalive, "poll_s": POLL_S,
               "ceiling_devices": max(passed) if passed else None,
               "first_failure": next((r["devices"] for r in runs if not r["goals_met"]), None),
               "runs": runs, "env": _environment()}
    write_results(getattr(args, "out", None), summary, _figures(summary) if getattr(args, "out", None) else {})
    return summary


def run_once(args, devices):
    """One run: broker, controllers and registry up, `devices` simulated devices, all torn down."""
    import asyncio
    import tempfile

    from jetserve.fleet.registry import Registry

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="jetserve-fleet-load-") as workdir:
        accounts = {"device-%05d" % i: secrets.token_urlsafe(12) for i in range(devices)}
        # one account a replica: under use_username_as_clientid two on one account take each other's session
        controller_accounts = {"jetserve-fleet-%d" % i: secrets.token_urlsafe(12) for i in range(args.replicas)}
        users = {"%s/%s" % (FLEET, name): password for name, password in accounts.items()}  # deploy/acl's %u
        broker = Broker(workdir, dict(users, **controller_accounts), controllers=sorted(controller_accounts),
                        persistent=args.soak is not None).start()
        location = _registry_location(args, workdir)
        controllers = []
        try:
            controllers = [_controller(args, workdir, broker.port, location, user, password, i)
                           for i, (user, password) in enumerate(sorted(controller_accounts.items()))]
            _wait_subscribed(controllers)
            registry = Registry(location)
            fleet_sim = Simulation(args, broker.port, accounts, rng)
            poller = Poller(registry, fleet_sim, [c.metrics_url for c, _ in controllers])
            poller.start()
            cpu_before = dict(_cpu([broker.proc] + [c for c, _ in controllers]), self=sum(os.times()[:2]))
            started, load_before = time.time(), os.getloadavg()[0]
            faults = None
            if args.soak is not None:
                restart = [lambda generation, i=i, u=u, p=p: _controller(args, workdir, broker.port, location, u, p, i,
                                                                         generation)
                           for i, (u, p) in enumerate(sorted(controller_accounts.items()))]
                faults = Faults(args, broker, controllers, restart, poller, started).start()
            try:
                asyncio.run(fleet_sim.run())
            finally:
                if faults:
                    faults.stop()
            drained = poller.wait_drained(DRAIN_S)
            cpu = {k: round(v - cpu_before[k] + (faults.cpu_carried.get(k, 0.0) if faults else 0.0), 1)
                   for k, v in _cpu([broker.proc] + [c for c, _ in controllers]).items()}
            cpu["simulator+poller"] = round(sum(os.times()[:2]) - cpu_before["self"], 1)
            poller.stop()
            result = _measure(args, devices, fleet_sim, poller, started, drained, cpu)
            result.update(controllers=_controller_metrics(poller), load_avg_1m_before=round(load_before, 1),
                          load_avg_1m=round(os.getloadavg()[0], 1), queue_depth_max=poller.queue_depth_max)
            if faults:
                result.update(_soak_verdict(args, faults, fleet_sim, result))
            registry.close()
        finally:
            for process, log in controllers:
                process.terminate()
                try:
                    process.wait(20)
                except Exception:
                    process.kill()
                log.close()
            broker.stop()
            _drop_database(args, location)
    return result


class Broker:
    """mosquitto on a free loopback port with deploy/'s broker settings, ACL and one account a
    device (`mosquitto_passwd -U` hashes them all at once); each of `controllers` gets the shipped
    controller block of the ACL, as `deploy/add-user.sh controller NAME` appends it."""

    def __init__(self, workdir, accounts, controllers, persistent=False):
        import socket
        import subprocess

        self.dir = workdir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        passwd = os.path.join(workdir, "passwd")
        with open(passwd, "w") as f:
            f.writelines("%s:%s\n" % item for item in accounts.items())
        os.chmod(passwd, 0o600)
        subprocess.run(["mosquitto_passwd", "-U", passwd], check=True, timeout=600)
        deploy = os.path.join(_repo(), "deploy")
        kept = [line for line in open(os.path.join(deploy, "mosquitto.conf")).read().splitlines()
                if line.split(" ", 1)[0] in _BROKER_SETTINGS_KEPT]
        self.conf = os.path.join(workdir, "mosquitto.conf")
        with open(self.conf, "w") as f:
            # the listener first: use_username_as_clientid is per listener (above any, it opens 1883)
            f.write("\n".join(["listener %d 127.0.0.1" % self.port] + kept + [
                "password_file %s" % passwd,
                "acl_file %s" % _acl(deploy, workdir, controllers), "log_dest file %s/mosquitto.log" % workdir,
                "persistence %s" % ("true" if persistent else "false"), "persistence_location %s/" % workdir,
                "max_connections -1"]
                + (["user %s" % _user()] if os.geteuid() == 0 else [])) + "\n")
        self.proc = None

    def start(self):
        import socket
        import subprocess

        self.proc = subprocess.Popen(["mosquitto", "-c", self.conf], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mosquitto did not start; see %s/mosquitto.log" % self.dir)
                time.sleep(0.05)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)  # with persistence, SIGTERM writes the sessions and their queues first


# Broker settings taken from deploy/mosquitto.conf; listeners, files and logs are the run's own.
_BROKER_SETTINGS_KEPT = ("allow_anonymous", "use_username_as_clientid", "message_size_limit", "max_packet_size",
                         "max_queued_messages", "max_inflight_messages", "max_keepalive", "persistent_client_expiration")


class Relay:
    """A TCP relay in front of one device, so the test can cut the line (stop forwarding, keep
    both sockets open: a pulled cable) or kill it (close both: a crashed device)."""

    def __init__(self, port):
        self.port, self.cut_at, self.writers = port, None, []

    async def start(self):
        import asyncio

        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, device_reader, device_writer):
        import asyncio

        broker_reader, broker_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writers += [device_writer, broker_writer]
        await asyncio.gather(self._pipe(device_reader, broker_writer), self._pipe(broker_reader, device_writer),
                             return_exceptions=True)

    async def _pipe(self, reader, writer):
        while self.cut_at is None:
            data = await reader.read(65536)
            if not data or self.cut_at is not None:
                break
            writer.write(data)
            await writer.drain()
        if self.cut_at is None:
            writer.close()

    def cut(self):
        self.cut_at = time.time()

    def kill(self):
        self.cut_at = time.time()
        for writer in self.writers:
            writer.transport.abort()  # no DISCONNECT, no FIN handshake to wait for: the device is gone

    def close(self):
        for writer in self.writers:
            writer.transport.abort()
        self.server.close()


class Simulation:
    """Every device as a coroutine on one event loop; what each sent and when."""

    def __init__(self, args, port, accounts, rng):
        self.args, self.port, self.rng = args, port, rng
        self.names = sorted(accounts)
        self.accounts = accounts
        self.sent = {name: [] for name in self.names}  # acknowledged publish times, in order of n
        self.failed = {}  # name → why its session ended early
        down = rng.sample(self.names, int(len(self.names) * args.offline))
        self.killed, self.cut = set(down[::2]), set(down[1::2])
        self.gone_at = {}  # name → when it was killed or cut
        self.callback_errors = 0
        self.reconnects = 0  # sessions begun again after the broker ended one (soak)
        self.ended_at_stop = 0  # sessions a fault ended after the soak's last report was due
        self.health, self.birth = _documents()

    async def run(self):
        import asyncio

        import aiomqtt

        def quiet(loop, context):
            """A killed device's client reports its lost socket in callbacks too: counted, not printed
            (what matters, lost messages and failed sessions, is measured)."""
            if isinstance(context.get("exception"), (aiomqtt.MqttError, OSError, KeyError)):
                self.callback_errors += 1
            else:
                loop.default_exception_handler(context)

        asyncio.get_running_loop().set_exception_handler(quiet)
        relays = {}
        for name in self.killed | self.cut:
            relays[name] = Relay(self.port)
            relays[name].local_port = await relays[name].start()
        start = time.time() + 1.0
        stop_at = start + self.args.ramp + self.args.duration
        # late enough for every device to be up and reporting, early enough to be told under load
        away_at = start + self.args.ramp + max(self.args.duration / 2, self.args.duration - 1.5 * self.args.keepalive - 5)
        tasks = [asyncio.create_task(self._device(name, relays.get(name), start + self.args.ramp * i / len(self.names),
                                                  stop_at)) for i, name in enumerate(self.names)]
        await asyncio.sleep(max(0.0, away_at - time.time()))
        for name, relay in relays.items():
            (relay.kill if name in self.killed else relay.cut)()
            self.gone_at[name] = relay.cut_at
        done, late = await asyncio.wait(tasks, timeout=max(0.0, stop_at - time.time()) + 30)
        for task in late:  # a session stuck on a line that was cut: not ours to wait for
            task.cancel()
        for relay in relays.values():
            relay.close()

    async def _device(self, name, relay, connect_at, stop_at):
        """One device: a session with its birth, then a report every interval until `stop_at`. In a
        soak a session the broker ended is begun again after a pause (a new birth, bdSeq + 1), and
        the report it did not acknowledge is sent first, as the agent's outbox does; in a load run
        the device gives up (its failure is the result)."""
        import asyncio

        import aiomqtt

        from jetserve.wire import topics

        await asyncio.sleep(max(0.0, connect_at - time.time()))
        bdseq, epoch = self.rng.randrange(256), secrets.token_hex(8)
        topic = lambda kind: topics.topic(FLEET, name, kind)  # noqa: E731
        n, unacked = 0, []  # the reports not acknowledged yet, oldest first
        next_report = time.time() + self.rng.uniform(0, self.args.interval)
        while True:
            will = aiomqtt.Will(topic(topics.STATE), json.dumps({"online": False, "bdSeq": bdseq}), qos=1)  # Sparkplug: not retained
            client = aiomqtt.Client("127.0.0.1", relay.local_port if relay else self.port, identifier="jetserve-%s-%s"
                                    % (FLEET, name), username="%s/%s" % (FLEET, name), password=self.accounts[name],
                                    will=will, protocol=aiomqtt.ProtocolVersion.V5, keepalive=self.args.keepalive,
                                    timeout=60)
            try:
                async with client:
                    birth = dict(self.birth, online=True, device=name, fleet=FLEET, bdSeq=bdseq, seq=0, ts=time.time(),
                                 interval=self.args.interval, keepalive=self.args.keepalive)
                    await client.publish(topic(topics.STATE), json.dumps(birth), qos=1)
                    while name not in self.gone_at:
                        if not unacked:
                            if next_report >= stop_at:
                                return
                            await asyncio.sleep(max(0.0, next_report - time.time()))
                            if name in self.gone_at:
                                break
                            next_report += self.args.interval
                            kinds = [topics.ALERT] if (n + 1) % self.args.alert_every == 0 else []
                            for kind in kinds + [topics.HEALTH]:
                                n += 1
                                doc = self._alert() if kind == topics.ALERT else dict(self.health, ts=time.time())
                                doc.update(epoch=epoch, n=n, seq=n % 256)  # Sparkplug's seq, +1 from the birth
                                unacked.append((kind, doc))
                        kind, doc = unacked[0]
                        published = time.time()
                        await client.publish(topic(kind), json.dumps(doc), qos=1)
                        unacked.pop(0)
                        if name not in self.gone_at:  # acknowledged before it went away
                            self.sent[name].append(published)
                    return
            except aiomqtt.MqttError as exc:
                if name in self.gone_at:
                    return
                if self.args.soak is not None and time.time() >= stop_at:
                    # a session a fault ended as the soak stops: its report was never acknowledged
                    # (so not counted as sent), and the device stops here anyway
                    self.ended_at_stop += 1
                    return
                if self.args.soak is None:
                    self.failed[name] = str(exc)
                    return
                self.reconnects += 1
                bdseq = (bdseq + 1) % 256
                await asyncio.sleep(self.rng.uniform(1, 5))  # spread: a fleet does not come back in one instant

    def _alert(self):
        return {"type": "thermal", "old": "normal", "new": "shed", "zone": "cpu-thermal", "temp_c": 95.0,
                "calls": ["SetLimits(max_num_seqs=4, num_speculative_tokens=0)"], "ok": True, "ts": time.time()}


class Poller:
    """Reads the registry every POLL_S on a thread: when each message became visible (its
    device's `received` count reached it) and when each device that went away showed offline;
    and the controllers' /metrics every SCRAPE_S, for the deepest their queues got."""

    def __init__(self, registry, simulation, metrics_urls):
        import threading

        self.registry, self.sim, self.metrics_urls = registry, simulation, metrics_urls
        self.queue_depth_max = 0
        self._scraped_at = 0.0
        self.visible = {}  # name → [time message k became visible, ...]
        self.offline_at = {}
        self.timeline = []  # (time, messages counted so far)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="registry-poller", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join(30)

    def _loop(self):
        while not self._stop.wait(POLL_S):
            self.poll()
            if time.time() - self._scraped_at >= SCRAPE_S:
                self._scraped_at = time.time()
                try:
                    depth = sum(_samples(text, "jetserve_fleet_queue_depth_messages")[()] for text in self.scrape())
                except OSError:  # a controller that stopped answering: the run's results say what it lost
                    continue
                self.queue_depth_max = max(self.queue_depth_max, int(depth))

    def scrape(self):
        """Each controller's /metrics text."""
        import urllib.request

        return [urllib.request.urlopen(url, timeout=10).read().decode() for url in self.metrics_urls]

    def poll(self):
        now = time.time()
        progress = self.registry.progress(FLEET)
        total = 0
        for (_, name), (online, received) in progress.items():
            seen = self.visible.setdefault(name, [])
            seen.extend([now] * (received - len(seen)))
            total += received
            if not online and name in self.sim.gone_at and name not in self.offline_at:
                self.offline_at[name] = now
        self.timeline.append((now, total))

    def wait_drained(self, timeout):
        """True once every acknowledged message is counted (and every device gone shows offline)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            counted = all(len(self.visible.get(n, ())) >= len(s) for n, s in self.sim.sent.items())
            if counted and set(self.offline_at) >= set(self.sim.gone_at):
                return True
            time.sleep(POLL_S)
        return False


class Faults:
    """A soak's faults, on a thread: the broker restarted (SIGTERM, so it writes its sessions and
    queues to disk as a `systemctl restart` has it, then started again on its port) every
    `fault_every` seconds, and each controller killed with SIGKILL half a period after it and
    started again (the same client id, so the same persistent session); the RSS of the
    controllers and of the broker once a second. Faults stop 30 s before the devices go away, so
    the offline rule is measured on a fleet that is up."""

    def __init__(self, args, broker, controllers, restart, poller, started):
        import threading

        self.args, self.broker, self.controllers, self.restart, self.poller = args, broker, controllers, restart, poller
        self.started = started
        self.events = []  # {"t", "kind", "down_s"}
        self.rss = []  # {"t", "controllers": [MB], "lives": [generation], "broker": MB}
        self.lives = [0] * len(controllers)
        self.cpu_carried = {}
        self.error = None
        last = started + 1.0 + args.ramp + max(args.duration / 2, args.duration - 1.5 * args.keepalive - 5) - 30
        period = args.fault_every
        self.schedule = sorted([(started + k * period, "broker restart") for k in range(1, int(args.duration // period) + 1)]
                               + [(started + (k - 0.5) * period, "controller kill -9")
                                  for k in range(1, int(args.duration // period) + 2)])
        self.schedule = [(t, kind) for t, kind in self.schedule if t < last]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-faults", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(300)
        if self.error:
            raise RuntimeError("a soak fault could not be undone: %s" % self.error)

    def _loop(self):
        try:
            while not self._stop.wait(SCRAPE_S):
                self._sample()
                if self.schedule and time.time() >= self.schedule[0][0]:
                    _, kind = self.schedule.pop(0)
                    began = time.time()
                    (self._restart_broker if kind == "broker restart" else self._kill_controllers)()
                    self.events.append({"t": round(began - self.started, 1), "kind": kind,
                                        "down_s": round(time.time() - began, 2)})
                    print("[bench fleet soak] %.0f s: %s, back in %.1f s" % (began - self.started, kind,
                                                                           time.time() - began), file=sys.stderr,
                          flush=True)
        except Exception as exc:  # noqa: BLE001 - raised by stop(), in the main thread
            self.error = "%s: %s" % (type(exc).__name__, exc)
            print("[bench fleet soak] faults stopped: %s" % self.error, file=sys.stderr, flush=True)

    def _sample(self):
        import psutil

        def mb(process):
            try:
                return round(psutil.Process(process.pid).memory_info().rss / 2**20, 2)
            except psutil.Error:
                return None

        self.rss.append({"t": round(time.time() - self.started, 1), "controllers": [mb(p) for p, _ in self.controllers],
                         "lives": list(self.lives), "broker": mb(self.broker.proc)})

    def _carry(self, key, process):
        import psutil

        try:
            self.cpu_carried[key] = self.cpu_carried.get(key, 0.0) + sum(psutil.Process(process.pid).cpu_times()[:2])
        except psutil.Error:
            pass

    def _restart_broker(self):
        self._carry("broker", self.broker.proc)
        self.broker.stop()
        self.broker.start()

    def _kill_controllers(self):
        for i, (process, log) in enumerate(list(self.controllers)):
            self._carry("controller-%d" % i, process)
            process.kill()
            process.wait(60)
            log.close()
            self.lives[i] += 1
            new = self.restart[i](generation=self.lives[i])
            self.controllers[i] = new
            _wait_subscribed([new])
            self.poller.metrics_urls[i] = new[0].metrics_url


def _soak_verdict(args, faults, sim, result):
    """Nothing lost, every device back after each fault, and each controller's RSS flat over each
    of its lives: the median of its last tenth within `rss_tolerance` of the median of the tenth
    after its warm-up (RSS_WARMUP of that life)."""
    from jetserve.bench.common import median

    lives = []
    for i in range(args.replicas):
        for life in sorted({s["lives"][i] for s in faults.rss}):
            values = [s["controllers"][i] for s in faults.rss if s["lives"][i] == life and s["controllers"][i]]
            n = len(values)
            if n < 20:  # a life too short to tell (the run's end); listed, not judged
                lives.append({"controller": i, "life": life, "samples": n, "growth": None})
                continue
            warm = median(values[int(RSS_WARMUP * n):int((RSS_WARMUP + 0.1) * n)])
            last = median(values[int(0.9 * n):])
            lives.append({"controller": i, "life": life, "samples": n, "after_warmup_mb": warm, "last_tenth_mb": last,
                          "max_mb": max(values), "growth": round(last / warm - 1, 4)})
    judged = [life for life in lives if life["growth"] is not None]
    rss_flat = bool(judged) and all(life["growth"] <= args.rss_tolerance for life in judged)
    offline_ok = all(kind["detected"] == kind["devices"] for kind in result["offline"].values())
    goals = bool(result["lost"] == 0 and result["drained"] and not sim.failed and rss_flat and offline_ok)
    every = max(1, len(faults.rss) // 720)  # at most 720 points in the result
    return {"goals_met": goals, "soak": {
        "minutes": args.soak, "fault_every_s": args.fault_every, "faults": faults.events, "reconnects": sim.reconnects,
        "sessions_ended_at_stop": sim.ended_at_stop,
        "controller_rss": {"lives": lives, "flat": rss_flat, "tolerance": args.rss_tolerance},
        "broker_rss_mb": {"first": faults.rss[0]["broker"] if faults.rss else None,
                          "last": faults.rss[-1]["broker"] if faults.rss else None},
        "rss_series": faults.rss[::every]}}


def _measure(args, devices, sim, poller, started, drained, cpu):
    from jetserve.bench.common import percentile

    lags, lost, extra = [], 0, 0
    for name, sent in sim.sent.items():
        seen = poller.visible.get(name, [])
        lost += max(0, len(sent) - len(seen))
        extra += max(0, len(seen) - len(sent))  # counted, though the ack never came back (device gone)
        lags += [v - s for s, v in zip(sent, seen)]
    detection = {kind: sorted(poller.offline_at[n] - sim.gone_at[n] for n in names if n in poller.offline_at)
                 for kind, names in (("killed", sim.killed), ("cut", sim.cut)) if names}
    bound = 1.5 * args.keepalive
    messages = sum(len(s) for s in sim.sent.values())
    window = args.duration + args.ramp
    offline_ok = len(poller.offline_at) == len(sim.gone_at) and all(d <= bound for ds in detection.values() for d in ds)
    p99 = percentile(lags, 99)
    buckets = {}
    for name, sent in sim.sent.items():
        for s, v in zip(sent, poller.visible.get(name, [])):
            buckets.setdefault(int((s - started) // 10) * 10, []).append(v - s)
    return {
        "devices": devices, "backend": args.backend, "replicas": args.replicas,
        "messages": messages, "msg_per_s": round(messages / window, 1),
        "lag_p50_s": round(percentile(lags, 50), 3), "lag_p99_s": round(p99, 3), "lag_max_s": round(max(lags), 3)
        if lags else None, "lost": lost, "counted_unacked": extra, "sessions_failed": len(sim.failed),
        "failures": sorted(set(sim.failed.values()))[:5], "drained": drained,
        "offline": {kind: {"devices": len(getattr(sim, kind)), "detected": len(ds),
                           "p50_s": round(percentile(ds, 50), 2) if ds else None, "max_s": round(max(ds), 2) if ds else None}
                    for kind, ds in detection.items()},
        "offline_bound_s": bound, "cpu_s": cpu, "priority": args.priority,
        "goals_met": bool(lost == 0 and not sim.failed and drained and p99 <= args.lag_goal and offline_ok),
        "series": {"lag_p99_by_10s": {k: round(percentile(v, 99), 3) for k, v in sorted(buckets.items())}},
    }


def _samples(text, name):
    """{labels as a sorted tuple of (key, value): value} of one metric's samples in `text`."""
    from prometheus_client.parser import text_string_to_metric_families

    return {tuple(sorted(sample.labels.items())): sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name}


def _quantile(buckets, q):
    """Prometheus' histogram_quantile over cumulative {upper bound: count}: linear in a bucket."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if not total:
        return None
    rank, below, lower = q * total, 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(buckets[bound] - below, 1e-12)
        below, lower = buckets[bound], bound
    return lower


def _controller_metrics(poller):
    """The controllers' own view, summed over replicas: lag device timestamp → commit (p50/p99
    from the histogram's buckets), messages per transaction, retried transactions, outcomes;
    None when a controller does not answer (it stopped, or predates /metrics)."""
    try:
        texts = poller.scrape()
    except OSError:
        return None
    lag, batch_sum, batches, retried, outcomes = {}, 0.0, 0.0, 0.0, {}
    for text in texts:
        for labels, value in _samples(text, "jetserve_fleet_registry_lag_seconds_bucket").items():
            bound = float(dict(labels)["le"])
            lag[bound] = lag.get(bound, 0.0) + value
        batch_sum += sum(_samples(text, "jetserve_fleet_batch_messages_sum").values())
        batches += sum(_samples(text, "jetserve_fleet_batch_messages_count").values())
        retried += sum(_samples(text, "jetserve_fleet_store_errors_total").values())
        for labels, value in _samples(text, "jetserve_fleet_messages_total").items():
            key = "%s/%s" % (dict(labels)["kind"], dict(labels)["outcome"])
            outcomes[key] = outcomes.get(key, 0) + int(value)
    return {"lag_p50_s": round(_quantile(lag, 0.5), 3) if lag else None,
            "lag_p99_s": round(_quantile(lag, 0.99), 3) if lag else None,
            "transactions": int(batches), "messages_per_transaction": round(batch_sum / batches, 1) if batches else None,
            "retried_transactions": int(retried), "outcomes": dict(sorted(outcomes.items()))}


def _figures(summary):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in summary["runs"]:
        series = r["series"]["lag_p99_by_10s"]
        left.plot([int(k) for k in series], list(series.values()), marker="o",
                  label="%d devices%s" % (r["devices"], "" if r["goals_met"] else " (missed)"))
    left.axhline(1.0, color="red", linestyle="--", linewidth=1, label="goal 1 s")
    left.set(xlabel="seconds into the run (publish time)", ylabel="lag p99 (s)",
             title="publish → counted in the registry, p99 per 10 s")
    left.legend(fontsize=8)
    runs = summary["runs"]
    right.plot([r["devices"] for r in runs], [r["lag_p50_s"] for r in runs], marker="o", label="lag p50")
    right.plot([r["devices"] for r in runs], [r["lag_p99_s"] for r in runs], marker="o", label="lag p99")
    right.axhline(1.0, color="red", linestyle="--", linewidth=1)
    right.set(xlabel="devices (one health each %g s)" % summary["interval_s"], ylabel="s",
              title="%s, %d controller(s): ceiling %s devices" % (summary["backend"], summary["replicas"],
                                                                   summary["ceiling_devices"]))
    right.legend(fontsize=8)
    fig.tight_layout()
    figures = {"fleet-load": fig}
    for r in summary["runs"]:
        if "soak" in r:
            figures["fleet-soak"] = _soak_figure(r)
    return figures


def _soak_figure(r):
    """A soak's controller and broker RSS over time, the faults marked, and its lag p99 per 10 s."""
    import matplotlib.pyplot as plt

    soak = r["soak"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    series = soak["rss_series"]
    t = [s["t"] / 60 for s in series]
    for i in range(len(series[0]["controllers"]) if series else 0):
        top.plot(t, [s["controllers"][i] for s in series], label="controller %d" % i)
    top.plot(t, [s["broker"] for s in series], label="broker (mosquitto)")
    top.set(ylabel="RSS (MB)", title="%d devices, %g min soak: RSS (controller flat: %s); lost %d of %d" % (
        r["devices"], soak["minutes"], soak["controller_rss"]["flat"], r["lost"], r["messages"]))
    lag = r["series"]["lag_p99_by_10s"]
    bottom.plot([int(k) / 60 for k in lag], list(lag.values()), marker=".", lw=0.8)
    bottom.set(xlabel="minutes", ylabel="lag p99 (s), per 10 s", yscale="log",
               title="publish → counted in the registry")
    for ax in (top, bottom):
        for f in soak["faults"]:
            ax.axvline(f["t"] / 60, color="red" if f["kind"] == "broker restart" else "purple", lw=0.6, ls="--")
    top.plot([], [], color="red", ls="--", label="broker restart")
    top.plot([], [], color="purple", ls="--", label="controller kill -9")
    top.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _documents():
    """A real agent's health document and birth (from a bundled device's files, in a source
    checkout; else this machine's own), to send as is."""
    from jetserve import __version__
    from jetserve.agent import health
    from jetserve.config import DEFAULT_ADDRESS
    from jetserve.device import compat
    from jetserve.device.probe import probe

    sysroot = os.path.join(_repo(), "tests", "agent", "sysroots", "agx-orin-jp62")
    found = probe(sysroot if os.path.isdir(sysroot) else "/")
    verdict = compat.check(found)
    service = {"health": "SERVING", "stats": {"max_num_seqs": 8, "num_requests_running": 1}}
    doc = health.build(found, verdict, service, 0, {"pending": 0, "dropped": {"health": 0, "alert": 0}})
    birth = {"model": found.get("model"), "soc": found.get("soc"), "serial": found.get("serial"),
             "service": DEFAULT_ADDRESS, "compat": verdict.to_dict(),
             "versions": {"jetserve": __version__, "python": found.get("python"), "l4t": found.get("l4t"),
                          "jetpack": found.get("jetpack"), "cuda": found.get("cuda")}}
    return doc, birth


def _acl(deploy, workdir, controllers):
    """deploy/acl with its controller block (`user jetserve-fleet` and its topics) once for each
    of `controllers`; the path of the copy."""
    shipped = open(os.path.join(deploy, "acl")).read()
    block = shipped[shipped.index("user jetserve-fleet\n"):].split("\n\n")[0].strip().split("\n")[1:]
    path = os.path.join(workdir, "acl")
    with open(path, "w") as f:
        f.write(shipped + "".join("\nuser %s\n%s\n" % (name, "\n".join(block)) for name in controllers))
    return path


def _controller(args, workdir, port, location, user, password, index, generation=0):
    import subprocess

    secret = os.path.join(workdir, "controller-%d-password" % index)
    with open(secret, "w") as f:
        f.write(password)
    log = open(os.path.join(workdir, "controller-%d%s.log" % (index, ".%d" % generation if generation else "")), "wb")
    command = [sys.executable, "-m", "jetserve.cli", "fleet", "run", "--db", location, "--http", "127.0.0.1:0",
               "--mqtt-port", str(port), "--mqtt-user", user, "--mqtt-password-file", secret,
               "--client-id", "jetserve-fleet-load-%d" % index, "--log-level", "INFO"]
    if args.replicas > 1:
        command += ["--share", "load"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    process.log_path = log.name
    return process, log


def _wait_subscribed(controllers):
    """Wait for each controller's subscription; each gets `metrics_url` (from its log's page line)."""
    import re

    deadline = time.monotonic() + 60
    for process, _ in controllers:
        while "subscribed" not in open(process.log_path).read():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("a controller did not subscribe: %s" % open(process.log_path).read()[-2000:])
            time.sleep(0.1)
        page = re.search(r"fleet page on (http://[0-9.]+:[0-9]+)/", open(process.log_path).read())
        process.metrics_url = page.group(1) + "/metrics"


def _registry_location(args, workdir):
    """An SQLite file in the run's folder, or a database of its own on the PostgreSQL server."""
    if args.backend == "sqlite":
        return os.path.join(workdir, "fleet.db")
    import urllib.parse

    import psycopg

    name = "jetserve_load_" + secrets.token_hex(6)
    with psycopg.connect(args.postgres, autocommit=True) as admin:
        admin.execute("CREATE DATABASE %s" % name)
    info = psycopg.conninfo.conninfo_to_dict(args.postgres)
    info.pop("dbname", None)
    return "postgresql:///%s?%s" % (name, urllib.parse.urlencode(info, quote_via=urllib.parse.quote))


def _drop_database(args, location):
    if args.backend != "postgresql":
        return
    import psycopg

    with psycopg.connect(args.postgres, autocommit=True) as admin:
        admin.execute("DROP DATABASE IF EXISTS %s WITH (FORCE)" % location.split("?")[0].rpartition("/")[2])


def _cpu(processes):
    import psutil

    return {("broker" if i == 0 else "controller-%d" % (i - 1)): sum(psutil.Process(p.pid).cpu_times()[:2])
            for i, p in enumerate(processes)}


def _prioritize():
    """nice -10, inherited by the broker and the controllers started after. With autogroup
    (/proc/sys/kernel/sched_autogroup_enabled) a nice value counts only against the processes of
    the same session, so the session's group gets -10 as well (it outlives the run: start the
    bench with `setsid` to keep it to the run)."""
    os.nice(-10)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("-10")
    except OSError:  # no autogroup here, or not root: nice alone
        pass


def _raise_file_limit():
    """Two file descriptors a device (its socket here and at the broker, which inherits the limit)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _environment():
    import platform

    return {"python": platform.python_version(), "cpus": os.cpu_count(), "load_avg_1m_at_end": os.getloadavg()[0]}


def _repo():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user():
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    run(parser.parse_args())
