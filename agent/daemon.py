"""The agent's main loop: probe, apply the thermal policy, publish health, answer commands.

Everything runs on this one thread except paho's network thread and the outbox flusher; commands
arrive through a bounded queue so gRPC calls never run inside an MQTT callback.
"""

import logging
import os
import queue
import threading
import time

from jetserve import __version__
from jetserve.agent import commands, health, thermal
from jetserve.agent.outbox import Outbox
from jetserve.agent.publisher import Publisher
from jetserve.agent.service import ServiceClient, read_control_token
from jetserve.config import from_args
from jetserve.device import compat
from jetserve.device.probe import JtopReader, probe
from jetserve.wire import messages
from jetserve.wire.mqtt import MqttOptions

log = logging.getLogger(__name__)
INBOX_LIMIT = 100  # commands received and waiting for the main loop


def _cut(text, limit):
    """`text` within `limit` characters, marked where it was cut."""
    return text if text is None or len(text) <= limit else text[:limit - 1] + "…"


def _text(value, limit):
    """A string read from a device file, cut to `limit`; None for anything that is not a string."""
    return _cut(value, limit) if isinstance(value, str) else None


class Agent:
    def __init__(self, args):
        self.args = args
        self.stop_event = threading.Event()
        self.inbox = queue.Queue(INBOX_LIMIT)
        self.jtop = self._open_jtop()
        first = probe(args.sysroot, self.jtop)
        self.verdict = compat.check(first)
        self.service = ServiceClient(args.service, timeout=args.service_timeout,
                                     control_token=read_control_token(args.service_token_file))
        self.policy = from_args(thermal.ThermalPolicy, args)
        self.shedder = thermal.Shedder(self.service)
        self.manual_drain = False
        self._last_shed_error = None
        self.outbox = Outbox(os.path.join(args.state_dir, "outbox-%s-%s.db" % (args.fleet, args.device_id)),
                             limit=args.outbox_limit)
        self.mqtt = MqttOptions.from_args(args)
        self.publisher = Publisher(self.mqtt, args.fleet, args.device_id, self.outbox, self._birth(first),
                                   self._received, reconnect_max=args.reconnect_max)
        self.actions = {
            "drain": lambda _: self._manual(self.service.drain, True),
            "resume": lambda _: self._manual(self.service.resume, False),
            "set-limits": lambda a: self.service.set_limits(**a),
            "report-now": lambda _: {"n": self.report()},
            "rebirth": lambda _: self.publisher.rebirth(),
        }

    def _open_jtop(self):
        if self.args.sysroot != "/" or self.args.no_jtop:
            return None
        reader = JtopReader()
        if reader.reason:
            log.info("using the agent's own sensor readers: %s", reader.reason)
            return None
        return reader

    def _birth(self, first):
        """What the device's files say (device tree, CUDA install) is kept to the wire's bounds
        (messages.MAX_FIELD characters, versions MAX_NAME) or is nothing: the controller refuses a
        whole birth for one field past them, at every rebirth it asks for."""
        field, name = messages.MAX_FIELD, messages.MAX_NAME
        return {"fleet": self.args.fleet, "device": self.args.device_id, "model": _text(first["model"], field),
                "soc": _text(first["soc"], field), "serial": _text(first["serial"], field),
                "interval": self.args.interval, "keepalive": self.args.keepalive,
                "service": _text(self.args.service, field),
                "versions": {key: _text(value, name) for key, value in (
                    ("jetserve", __version__), ("python", first["python"]), ("l4t", first["l4t"]),
                    ("jetpack", first["jetpack"]), ("cuda", first["cuda"]))},
                "compat": self.verdict.to_dict()}

    def _received(self, payload, response_topic, correlation, retained):
        """A command, on paho's thread: queued for the main loop, where it runs, or refused at once
        when it could not run anyway (over the size limit) or INBOX_LIMIT wait already. Commands
        run one at a time and may take the service's timeout each: what waits stays bounded in
        number and bytes whatever the senders do, and each sender hears why at once."""
        if len(payload) > messages.MAX_COMMAND:
            error = "payload of %d bytes is over the %d-byte limit" % (len(payload), messages.MAX_COMMAND)
        else:
            try:
                self.inbox.put_nowait((payload, response_topic, correlation, retained))
                return
            except queue.Full:
                error = "%d commands are waiting already; send it again once they are answered" % INBOX_LIMIT
        self.publisher.reply(commands.refuse(payload, error), response_topic, correlation)

    def _manual(self, call, drained):
        reply = call()
        self.manual_drain = drained
        return reply

    def report(self):
        """Probe, act on the thermal policy, publish the alerts then the health document."""
        result = probe(self.args.sysroot, self.jtop)
        transition = self.policy.decide(result["zones"])
        if transition:
            self._shed(transition)
        service = self.service.snapshot()
        doc = health.build(result, self.verdict, service, self.policy.level, self.outbox.stats())
        return self.publisher.publish("health", doc)

    def _shed(self, transition):
        """The alert keeps to the wire's bounds, or the controller refuses all of it: a gRPC error
        names a unix socket or a host name twice and runs past them, and a sysfs zone may name
        itself at any length (the health document's service error keeps the whole text)."""
        alert = dict(transition._asdict(), type="thermal", ts=time.time(),
                     zone=_cut(transition.zone, messages.MAX_FIELD))
        try:
            if self.manual_drain and transition.old == "drain":
                calls = ["Resume skipped: drained by an operator"]
            else:
                calls = self.shedder.apply(transition.old, transition.new)
            self.policy.commit(transition)
            alert.update(ok=True, calls=calls)
        except Exception as exc:  # service down: stay at the old level and try again next round
            alert.update(ok=False, error=_cut(str(exc), messages.MAX_FIELD))
        if alert["ok"] or alert.get("error") != self._last_shed_error:  # one alert per failure
            self.publisher.publish("alert", alert)
        self._last_shed_error = alert.get("error")
        log.warning("thermal %s → %s (%s %.1f °C): %s", transition.old, transition.new,
                    transition.zone, transition.temp_c or 0, alert.get("calls") or alert["error"])

    def run(self, once=False):
        """Run until `stop_event`; with `once`, one report then exit. Returns an exit status."""
        self.publisher.start()
        try:
            if once:
                self.report()
                if self.publisher.wait_flushed(self.args.once_timeout):
                    return 0
                log.error("broker %s not reachable within %ss; the report waits in the outbox",
                          self.mqtt.address, self.args.once_timeout)
                return 3
            next_report = time.monotonic()
            while not self.stop_event.is_set():
                if time.monotonic() >= next_report:
                    self.report()
                    next_report = time.monotonic() + self.args.interval
                try:
                    payload, response_topic, correlation, retained = self.inbox.get(
                        timeout=max(0.0, min(0.2, next_report - time.monotonic())))
                except queue.Empty:
                    continue
                if retained:
                    reply = commands.refuse(payload, "a retained command is not run: the broker hands it over again "
                                                     "at every connect; publish it without retain")
                elif response_topic is None or self.publisher.may_reply_to(response_topic):
                    reply = commands.execute(payload, self.actions)
                else:
                    reply = commands.refuse(payload, "response topic %r is not under %s"
                                            % (response_topic[:200], self.publisher.topic("cmd/reply")))
                self.publisher.reply(reply, response_topic, correlation)
            return 0
        finally:
            self.publisher.stop()
            self.service.close()
            self.outbox.close()
            if self.jtop:
                self.jtop.close()
