"""Read-only HTTP view of the registry: `/api/devices`, `/api/alerts` (JSON) and `/` (HTML).

The standard library's threading server is enough for an operator's page and a dashboard poll.
"""

import html
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>jetserve fleet</title>
<meta http-equiv="refresh" content="10"><style>body{font-family:sans-serif}
td,th{padding:2px 8px;text-align:left}.OK{color:green}.DEGRADED{color:#b80}.CRITICAL,.offline{color:red}
</style></head><body><h1>jetserve fleet</h1><table><tr><th>fleet</th><th>device</th><th>state</th>
<th>status</th><th>reasons</th><th>JetPack</th><th>last seen</th><th>gaps</th></tr>%s</table>
<h2>recent alerts</h2><table>%s</table></body></html>"""


def device_row(device):
    health = device["health"] or {}
    versions = (device["birth"] or {}).get("versions", {})
    state = "online" if device["online"] else "offline"
    return {"fleet": device["fleet"], "device": device["device"], "state": state,
            "status": device["status"] or "-", "reasons": "; ".join(health.get("reasons", [])),
            "jetpack": versions.get("jetpack") or "-",
            "last_seen": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(device["last_seen"]))
            if device["last_seen"] else "-", "gaps": device["gaps"]}


def render(devices, alerts):
    rows = "".join(
        "<tr><td>{fleet}</td><td>{device}</td><td class='{state}'>{state}</td>"
        "<td class='{status}'>{status}</td><td>{reasons}</td><td>{jetpack}</td><td>{last_seen}</td>"
        "<td>{gaps}</td></tr>".format(**{k: html.escape(str(v)) for k, v in device_row(d).items()})
        for d in devices)
    events = "".join("<tr><td>%s</td><td>%s/%s</td><td>%s</td><td>%s</td></tr>" % tuple(
        html.escape(str(v)) for v in (time.strftime("%H:%M:%S", time.localtime(a["ts"])), a["fleet"],
                                     a["device"], a["kind"], a["message"])) for a in alerts)
    return PAGE % (rows, events)


def serve(registry, host, port):
    """Start the server on a daemon thread; returns it (its `server_address` has the real port)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            url = urlparse(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if url.path == "/api/devices":
                self._send(200, "application/json", json.dumps(registry.devices(query.get("fleet"))))
            elif url.path == "/api/alerts":
                try:
                    limit = int(query.get("limit", 100))
                except ValueError:
                    return self._send(400, "application/json", json.dumps({"error": "limit must be an integer"}))
                self._send(200, "application/json",
                           json.dumps(registry.alerts(limit, query.get("fleet"), query.get("device"))))
            elif url.path == "/":
                self._send(200, "text/html; charset=utf-8", render(registry.devices(), registry.alerts(20)))
            else:
                self._send(404, "application/json", json.dumps({"error": "not found"}))

        def _send(self, code, content_type, body):
            data = body.encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # the controller's log is for the fleet, not for page views
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="fleet-http", daemon=True).start()
    return server
