"""The controller's HTTP side: the operator's page `/` and a JSON API, FastAPI on uvicorn.

- `/api/devices` (a summary a row, paged), `/api/devices/{fleet}/{device}` (the last birth and
  health documents), `/api/alerts`; every parameter bounded, a bad one is a 400 naming it, and so
  is one a route does not take or one given twice. Every route answers GET and HEAD.
- What devices reported is shown, never obeyed: escaped on the page, and a lone surrogate (which
  UTF-8 cannot carry) shown as U+FFFD. A registry that cannot be read now is a 503, anything
  else that fails a JSON 500 with the same headers; no traceback leaves the process.
- `/metrics`: the controller's Prometheus metrics (`jetserve_fleet_*`, fleet/metrics.py).
- With a token every route needs `Authorization: Bearer TOKEN`, or HTTP Basic with the token as
  the password, which is what a browser asks for. A non-loopback address is refused without a
  token and TLS (`check_exposure`); behind a reverse proxy, bind loopback and let it do TLS.
- Every answer carries a strict CSP (no script at all; the one inline style by its hash),
  nosniff, frame and referrer denial and no-store.
- Connections are capped below the process's file-descriptor budget (`jetserve.fdbudget`), so
  MQTT, the database and the log keep their descriptors: at the cap a new one takes the place
  of the oldest not being answered, or with none such gets a 503 at once.
  A connection must deliver each request within HEADER_TIMEOUT_S, so nobody can keep sockets
  open by saying nothing (or by saying it slowly).
"""

import base64
import hashlib
import hmac
import html
import ipaddress
import json
import logging
import re
import socket
import threading
import time
import urllib.parse

from jetserve import fdbudget
from jetserve.config import read_secret

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 1000  # wanted; the fd budget may grant fewer
RESERVE_FDS = 32  # for what opens after start: MQTT (re)connects, PostgreSQL reconnects, SQLite temp files, logs
NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # fleet and device names, as topic levels allow them
STYLE = ("body{font-family:system-ui,sans-serif;margin:1.5em}table{border-collapse:collapse;margin-bottom:1.5em}"
         "th,td{padding:3px 10px;text-align:left;border-bottom:1px solid #ddd;white-space:nowrap}th{background:#f3f3f3}"
         ".OK{color:#080}.DEGRADED{color:#b60}.CRITICAL,.OFFLINE{color:#c00;font-weight:bold}"
         ".UNKNOWN,.dim{color:#777}.summary{font-size:1.1em}"
         # Free text (reasons, alert messages) wraps within its column, so the page fits a laptop's width.
         "td.text{white-space:normal;overflow-wrap:anywhere;min-width:12em;max-width:32em}"
         "td.note{white-space:normal}.nw{white-space:nowrap}"
         # Names, versions and alert kinds may be 64 characters without a space: they break too.
         "#devices td:nth-child(-n+2),#devices td:nth-child(5),#alerts td:nth-child(2),#alerts td:nth-child(4)"
         "{white-space:normal;overflow-wrap:anywhere}")
# A reason longer than this is cut on the page (its cell's tooltip and /api/devices keep all of it).
REASON_CHARS = 160
# Reasons a device's cell shows at most, then how many more (the tooltip and /api/devices have
# all): a device sending hundreds would otherwise push every other device off the screen.
REASONS_SHOWN = 5
# A lone UTF-16 surrogate: JSON lets a device write "\ud800", Python keeps it as a character,
# and UTF-8 has no bytes for it.
SURROGATE = re.compile("[\ud800-\udfff]")
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'sha256-%s'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'" % base64.b64encode(hashlib.sha256(STYLE.encode()).digest())
                               .decode(),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def read_token(path):
    """The bearer token from `path`, which only its owner may read (like an SSH key)."""
    try:
        token = read_secret(path, "--http-token-file")
    except OSError as exc:
        raise ValueError("cannot read the HTTP token file %s: %s" % (path, exc.strerror))
    if len(token) < 16:
        raise ValueError("the HTTP token in %s is shorter than 16 characters; make one with: "
                         "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'" % path)
    return token


def check_exposure(host, token, tls):
    """Loopback may be served plainly; anything else needs a token and TLS."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host or None, None)}
    except socket.gaierror as exc:
        raise ValueError("cannot resolve the HTTP address %r: %s" % (host, exc))
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        return
    if not (token and tls):
        raise ValueError("serving HTTP on %s reaches beyond this host: give --http-token-file and "
                         "--http-tls-cert/--http-tls-key, or bind 127.0.0.1 behind a reverse proxy" % host)


def sound(text):
    """`text` with each lone surrogate replaced by U+FFFD, so it can be sent as UTF-8: one device
    reporting one would otherwise make the page and the API fail for every device."""
    return SURROGATE.sub("\ufffd", text)


def utc(ts):
    """A time as people read it, with its zone: `2026-11-30 12:15:26 UTC`."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts)) if ts else "-"


def device_row(device):
    """What an operator needs about a device: the summary the page, `fleet status` and
    /api/devices show. `state` is OFFLINE for an offline device, whatever it last reported."""
    health, birth = device["health"] or {}, device["birth"] or {}
    versions = birth.get("versions") if isinstance(birth.get("versions"), dict) else {}
    reasons = health.get("reasons") if isinstance(health.get("reasons"), list) else []
    return {"fleet": device["fleet"], "device": device["device"], "online": device["online"],
            "state": (device["status"] or "UNKNOWN") if device["online"] else "OFFLINE",
            "reason": device["reason"], "status": device["status"], "reasons": [str(r) for r in reasons],
            "conditions": device["conditions"], "jetpack": versions.get("jetpack"), "l4t": versions.get("l4t"),
            "jetserve": versions.get("jetserve"), "last_seen": device["last_seen"],
            "last_seen_utc": utc(device["last_seen"]), "received": device["received"],
            "duplicates": device["duplicates"], "gaps": device["gaps"], "bdseq": device["bdseq"]}


def render(counts, devices, alerts, offset, limit, now, fleet=None):
    """The page: a summary, devices (problems first) with table headers, recent alerts; its
    pager keeps the `fleet` shown."""
    e = lambda value: html.escape("-" if value is None else str(value))  # noqa: E731
    rows = []
    for d in map(device_row, devices):
        last = "" if d["online"] else " <span class='dim'>(%s; last report %s)</span>" % (
            e(d["reason"]), e(d["status"] or "none"))
        ago = " <span class='dim'>(%.0f s ago)</span>" % (now - d["last_seen"]) if d["last_seen"] else ""
        reasons = "; ".join(d["reasons"])
        # Each reason isolated (<bdi>): a right-to-left override in one would reverse the next.
        shown_reasons = "; ".join("<bdi>%s</bdi>" % e(r if len(r) <= REASON_CHARS else r[:REASON_CHARS - 1] + "…")
                                  for r in d["reasons"][:REASONS_SHOWN])
        if len(d["reasons"]) > REASONS_SHOWN:
            shown_reasons += "; and %d more" % (len(d["reasons"]) - REASONS_SHOWN)
        rows.append("<tr><td>%s</td><td>%s</td><td class='note'><span class='%s'>%s</span>%s</td>"
                    "<td class='text' title='%s'>%s</td><td>%s</td><td class='note'><span class='nw'>%s</span>%s</td>"
                    "<td>%s</td><td>%s</td></tr>"
                    % (e(d["fleet"]), e(d["device"]), e(d["state"]), e(d["state"]), last, e(reasons), shown_reasons,
                       e(d["jetpack"]), e(d["last_seen_utc"]), ago, e(d["received"]), e(d["gaps"])))
    events = ["<tr><td>%s</td><td>%s/%s</td><td>%s</td><td>%s</td><td class='text'>%s</td></tr>"
              % (e(utc(a["ts"])), e(a["fleet"]), e(a["device"]), e(a["source"]), e(a["kind"]), e(a["message"]))
              for a in alerts]
    shown = "%d–%d of %d" % (offset + 1, offset + len(devices), counts["devices"]) if devices else "none"
    # Past the end, "previous" leads to the last page, not to another empty one.
    last_page = (max(counts["devices"], 1) - 1) // limit * limit
    pager = "".join("<a href='/?%s'>%s</a> " % (e(urllib.parse.urlencode(
        ({"fleet": fleet} if fleet else {}) | {"offset": start, "limit": limit})), label) for start, label in (
        (max(min(offset - limit, last_page), 0), "← previous"), (offset + limit, "next →"))
        if (label.startswith("←") and offset > 0) or (label.startswith("next") and offset + limit < counts["devices"]))
    offline = counts["devices"] - counts["online"]
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'><title>jetserve fleet</title>"
            "<meta http-equiv='refresh' content='10'><style>%s</style></head><body><h1>jetserve fleet</h1>"
            "<p class='summary'>%d devices: %d online (<span class='OK'>%d OK</span>, <span class='DEGRADED'>%d "
            "DEGRADED</span>, <span class='CRITICAL'>%d CRITICAL</span>), <span class='OFFLINE'>%d offline</span>"
            " · as of %s</p>"
            "<table id='devices'><caption>Devices, problems first (%s)</caption><thead><tr><th scope='col'>Fleet</th>"
            "<th scope='col'>Device</th><th scope='col'>State</th><th scope='col'>Reasons</th>"
            "<th scope='col'>JetPack</th><th scope='col'>Last seen</th><th scope='col'>Messages</th>"
            "<th scope='col'>Gaps</th></tr></thead><tbody>%s</tbody></table><p>%s</p>"
            "<table id='alerts'><caption>Recent alerts</caption><thead><tr><th scope='col'>Time</th><th scope='col'>Device</th>"
            "<th scope='col'>Source</th><th scope='col'>Kind</th><th scope='col'>Message</th></tr></thead>"
            "<tbody>%s</tbody></table></body></html>"
            % (STYLE, counts["devices"], counts["online"], counts["OK"], counts["DEGRADED"], counts["CRITICAL"],
               offline, utc(now), shown, "".join(rows), pager, "".join(events)))


def create_app(registry, token=None, tls=False, metrics=None):
    """The ASGI app over `registry`; with `token`, every route needs it; with `metrics` (a
    prometheus_client CollectorRegistry) it serves them at /metrics."""
    from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse, Response

    from jetserve.fleet.stores import StoreError

    def authorized(request: Request):
        if token is None:
            return
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        presented = credentials.strip()
        if scheme.lower() == "basic":  # a browser: any user name, the token as the password
            try:
                presented = base64.b64decode(presented, validate=True).decode("utf-8").partition(":")[2]
            except ValueError:
                presented = ""
        elif scheme.lower() != "bearer":
            presented = ""
        if not hmac.compare_digest(presented.encode("utf-8", "replace"), token.encode("utf-8")):
            raise HTTPException(401, "a token is required: Authorization: Bearer TOKEN",
                                headers={"WWW-Authenticate": 'Basic realm="jetserve fleet", charset="UTF-8"'})

    class SoundJSON(JSONResponse):
        """FastAPI's JSON, sent as UTF-8 whatever the devices reported (`sound`)."""

        def render(self, content):
            return sound(json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))).encode()

    app = FastAPI(title="jetserve fleet", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(authorized)], default_response_class=SoundJSON)
    headers = dict(HEADERS, **({"Strict-Transport-Security": "max-age=31536000"} if tls else {}))

    @app.middleware("http")
    async def security_headers(request, call_next):
        response = await call_next(request)
        response.headers.update(headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(request, exc):
        problems = ["%s: %s" % (".".join(str(part) for part in error["loc"][1:]) or error["loc"][0], error["msg"])
                    for error in exc.errors()]
        return SoundJSON({"detail": "; ".join(problems)}, status_code=400)

    @app.exception_handler(StoreError)
    async def registry_unavailable(request, exc):
        log.warning("HTTP %s: %s", request.url.path, exc)
        return SoundJSON({"detail": "the registry database cannot be read now; try again in a moment"},
                         status_code=503, headers={"Retry-After": "5"})

    @app.exception_handler(Exception)
    async def failed(request, exc):
        # Answered outside the middleware above, so the headers go on here; the traceback goes
        # to the log (uvicorn's), never to the client.
        return SoundJSON({"detail": "internal error: the controller's log has the details"}, status_code=500,
                         headers=headers)

    def only(*names):
        """A dependency refusing a query parameter the route does not take (a typo such as
        `?ofset=` would otherwise silently show the first page) or one given twice (which of
        them applies would be a guess)."""
        def check(request: Request):
            seen = set()
            for key, _ in request.query_params.multi_items():
                if key not in names:
                    raise HTTPException(400, "%s: not a parameter of %s (it takes %s)" % (
                        key[:64], request.url.path[:64], ", ".join(names) or "none"))
                if key in seen:
                    raise HTTPException(400, "%s: given more than once" % key)
                seen.add(key)
        return [Depends(check)]

    def get(path, *names, **kwargs):
        """A read-only route: GET, and HEAD as HTTP wants of every server (`curl -I`, monitors)."""
        return app.api_route(path, methods=["GET", "HEAD"], dependencies=only(*names), **kwargs)

    fleet_query = Query(None, pattern=NAME, description="only this fleet")
    offset_query = Query(0, ge=0, le=10 ** 6)

    @get("/", "fleet", "offset", "limit", response_class=HTMLResponse)
    def page(fleet: str | None = fleet_query, offset: int = offset_query, limit: int = Query(200, ge=1, le=1000)):
        return sound(render(registry.counts(fleet), registry.devices(fleet, limit, offset, problems_first=True),
                            registry.alerts(20, fleet), offset, limit, time.time(), fleet))

    @get("/api/devices", "fleet", "offset", "limit")
    def devices(fleet: str | None = fleet_query, offset: int = offset_query,
                limit: int = Query(1000, ge=1, le=5000)):
        return {"counts": registry.counts(fleet), "offset": offset,
                "devices": [device_row(d) for d in registry.devices(fleet, limit, offset)]}

    @get("/api/devices/{fleet}/{device}")
    def one_device(fleet: str = Path(pattern=NAME), device: str = Path(pattern=NAME)):
        found = registry.devices(fleet, device=device)
        if not found:
            raise HTTPException(404, "no device %s/%s" % (fleet, device))
        return dict(device_row(found[0]), birth=found[0]["birth"], health=found[0]["health"])

    @get("/api/alerts", "fleet", "device", "limit")
    def alerts(fleet: str | None = fleet_query, device: str | None = Query(None, pattern=NAME),
               limit: int = Query(100, ge=1, le=1000)):
        return {"alerts": registry.alerts(limit, fleet, device)}

    if metrics is not None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        @app.api_route("/metrics", methods=["GET", "HEAD"])  # a scrape job may add parameters of its own
        def prometheus():
            return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    return app


class Server:
    """uvicorn on a thread of its own; `address` is where it listens (port 0 → the real one).
    At most `max_connections` are open at once (`Budget.caps`, below the process's fd limit)."""

    def __init__(self, registry, host, port, token=None, tls_cert=None, tls_key=None, metrics=None,
                 max_connections=MAX_CONNECTIONS, header_timeout=None):
        import logging

        import uvicorn

        refusal = None if tls_cert else fdbudget.http_refusal(
            b"the fleet page is at its connection limit; retry in a moment\n")
        self._listener = fdbudget.listen(host, port, max_connections, refusal)
        config = uvicorn.Config(create_app(registry, token, tls=bool(tls_cert), metrics=metrics), loop="asyncio",
                                http=fdbudget.http_protocol(
                                    HEADER_TIMEOUT_S if header_timeout is None else header_timeout),
                                ssl_certfile=tls_cert, ssl_keyfile=tls_key, access_log=False,
                                log_level=logging.WARNING, timeout_keep_alive=5, server_header=False,
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._listener.connections = self._server.server_state.connections
        self._thread = threading.Thread(target=self._server.run, args=([self._listener],), name="fleet-http",
                                        daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                self._listener.close()
                raise OSError("cannot serve HTTP on %s:%d (see the log above)" % (host, port))
            time.sleep(0.02)
        self.address = self._server.servers[0].sockets[0].getsockname()[:2]
        self.scheme = "https" if tls_cert else "http"

    def stop(self):
        self._server.should_exit = True
        self._thread.join(10)
