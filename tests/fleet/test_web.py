"""The fleet's HTTP side on a real uvicorn: the page in a real headless Chromium, the probes of
issue 17 (headers, auth, bounds, idle connections), TLS, and the CLI's refusal to expose it."""

import base64
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from jetserve.fleet import web
from jetserve.fleet.registry import Registry
from tests.agent.conftest import REPO
from tests.fleet.test_registry import health
from tests.tools import require_tool

TOKEN = "t0k-" + "x" * 28


@pytest.fixture
def registry(tmp_path):
    """Four devices: OK, DEGRADED, CRITICAL, and one offline whose last report was OK."""
    r = Registry(str(tmp_path / "fleet.db"))
    now = time.time()
    for name, status in (("orin-ok", "OK"), ("orin-hot", "DEGRADED"), ("orin-crit", "CRITICAL"), ("orin-gone", "OK")):
        r.state("lab", name, {"online": True, "bdSeq": 3, "interval": 10.0, "serial": "SERIAL-" + name,
                              "versions": {"jetpack": "6.2"}}, now=now - 20)
        r.data("lab", name, "health", health(1, status=status, reasons=[] if status == "OK" else ["cpu 95 C"]),
               now=now - 5)
    r.state("lab", "orin-gone", {"online": False, "bdSeq": 3})
    yield r
    r.close()


@pytest.fixture
def serve(registry):
    servers = []

    def start(**kwargs):
        servers.append(web.Server(registry, "127.0.0.1", 0, **kwargs))
        return "%s://127.0.0.1:%d" % (servers[-1].scheme, servers[-1].address[1])

    yield start
    for server in servers:
        server.stop()


def get(url, token=None, basic=None, context=None):
    """(status, headers, body) of a GET; an HTTP error status is returned, not raised."""
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", "Bearer " + token)
    if basic:
        request.add_header("Authorization", "Basic " + base64.b64encode(basic.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def chromium(*args):
    binary = require_tool("chromium")
    out = subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--user-data-dir=%s" % args[0]] + list(args[1:]),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    return out.stdout.decode()


def test_page_in_headless_chromium_tells_offline_from_ok(serve, tmp_path):
    url = serve(token=TOKEN).replace("://", "://operator:%s@" % TOKEN) + "/"
    dom = chromium(str(tmp_path / "profile"), "--dump-dom", url)
    rows = {m.group(1): m.group(2) for m in re.finditer(r"<tr><td>lab</td><td>([\w-]+)</td>(.*?)</tr>", dom)}
    assert set(rows) == {"orin-ok", "orin-hot", "orin-crit", "orin-gone"}
    assert "<span class=\"OFFLINE\">OFFLINE</span>" in rows["orin-gone"]
    assert "class=\"OK\"" not in rows["orin-gone"], "an offline device is never a green OK"
    assert "last report OK" in rows["orin-gone"] and "death certificate" in rows["orin-gone"]
    assert "<span class=\"OK\">OK</span>" in rows["orin-ok"]
    assert "<span class=\"CRITICAL\">CRITICAL</span>" in rows["orin-crit"]
    assert list(rows)[:2] == ["orin-gone", "orin-crit"], "problems first"
    assert dom.count("<thead>") == 2 and "<th scope=\"col\">Last seen</th>" in dom and "<th scope=\"col\">Time</th>" in dom
    times = re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d( UTC)?", dom)
    assert len(times) >= 6 and all(times), "every time shown carries its zone"
    assert "1 offline" in dom and "3 online" in dom
    # No token, no page: Chromium gets the 401 (an empty document in headless mode).
    assert "orin-ok" not in chromium(str(tmp_path / "profile2"), "--dump-dom", url.replace(TOKEN, "wrong"))
    shot = tmp_path / "fleet.png"
    chromium(str(tmp_path / "profile3"), "--window-size=1200,600", "--screenshot=%s" % shot, url)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10000
    print("screenshot:", shot)


def test_http_probes(serve):
    """Issue 17's probes: security headers, auth on the API, bounded parameters, no serials listed."""
    base = serve(token=TOKEN)
    status, headers, body = get(base + "/api/devices")
    assert status == 401 and "Basic" in headers["WWW-Authenticate"]
    assert get(base + "/api/devices", token=TOKEN[:-1] + "y")[0] == 401
    assert get(base + "/api/devices", basic="anyone:" + TOKEN)[0] == 200
    status, headers, body = get(base + "/api/devices", token=TOKEN)
    assert status == 200 and json.loads(body)["counts"] == {"devices": 4, "online": 3, "OK": 1, "DEGRADED": 1,
                                                             "CRITICAL": 1}
    assert b"SERIAL-" not in body, "the list carries no serials or documents"
    assert b"SERIAL-orin-ok" in get(base + "/api/devices/lab/orin-ok", token=TOKEN)[2]
    for path in ("/", "/api/devices", "/api/alerts?limit=0", "/nope"):
        for token in (TOKEN, None):
            headers = get(base + path, token=token)[1]
            assert "default-src 'none'" in headers["Content-Security-Policy"], path
            assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
            assert headers["X-Content-Type-Options"] == "nosniff" and headers["X-Frame-Options"] == "DENY"
            assert headers["Referrer-Policy"] == "no-referrer" and headers["Cache-Control"] == "no-store"
    for query, field in (("/api/alerts?limit=99999999999999999999", "limit"), ("/api/alerts?limit=0", "limit"),
                         ("/api/alerts?limit=ten", "limit"), ("/api/devices?offset=-1", "offset"),
                         ("/api/devices?fleet=../etc", "fleet"), ("/?limit=100000", "limit"),
                         ("/api/alerts?device=" + "d" * 65, "device")):
        status, _, body = get(base + query, token=TOKEN)
        assert status == 400 and json.loads(body)["detail"].startswith(field + ":"), (query, body)
    assert len(json.loads(get(base + "/api/alerts?limit=1000", token=TOKEN)[2])["alerts"]) == 1
    assert get(base + "/api/devices/lab/nobody", token=TOKEN)[0] == 404


def test_idle_and_dribbling_connections_neither_block_the_page_nor_stay_forever(serve, monkeypatch):
    monkeypatch.setattr(web, "HEADER_TIMEOUT_S", 1.0)
    base = serve()
    port = int(base.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(80)]
    dribbling = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(40)]
    for s in dribbling:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # headers never finished
    try:
        for _ in range(3):
            status, _, body = get(base + "/")
            assert status == 200 and b"orin-ok" in body
        for s in idle + dribbling:  # all closed by the server once the header deadline passed
            assert s.recv(1) == b"", "the server closed the connection"
    finally:
        for s in idle + dribbling:
            s.close()


def test_tls(serve, tmp_path):
    require_tool("openssl")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    base = serve(token=TOKEN, tls_cert=cert, tls_key=key)
    assert base.startswith("https://")
    context = ssl.create_default_context(cafile=cert)
    status, headers, _ = get(base + "/api/devices", token=TOKEN, context=context)
    assert status == 200 and headers["Strict-Transport-Security"].startswith("max-age=")
    with pytest.raises(urllib.error.URLError):
        get(base + "/api/devices", token=TOKEN)  # a client that does not trust the certificate


def fleet_run(*args):
    return subprocess.run([sys.executable, "-m", "jetserve.cli", "fleet", "run", "--db", ":memory:",
                           "--mqtt-port", "1"] + list(args), cwd=REPO, capture_output=True, timeout=60)


def test_cli_refuses_to_expose_the_page_without_a_token_and_tls(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    os.chmod(token, 0o644)
    out = fleet_run("--http", "0.0.0.0:8080")
    assert out.returncode != 0 and b"--http-token-file" in out.stderr and b"reverse proxy" in out.stderr
    out = fleet_run("--http", "127.0.0.1:8080", "--http-token-file", str(token))
    assert out.returncode != 0 and b"chmod 600" in out.stderr
    os.chmod(token, 0o600)
    out = fleet_run("--http", "0.0.0.0:8080", "--http-token-file", str(token))
    assert out.returncode != 0 and b"--http-tls-cert" in out.stderr, "a token alone crosses the network in clear"
    token.write_text("short")
    out = fleet_run("--http", "[::1]:8080", "--http-token-file", str(token))
    assert out.returncode != 0 and b"shorter than 16" in out.stderr


def test_compose_serves_the_page_beyond_loopback_only_with_a_token_and_tls():
    from jetserve.cli import build_parser

    with open(os.path.join(REPO, "deploy/compose.yaml")) as f:
        command = re.search(r"command: >\n(.*?jetserve fleet run.*?)\n\s*secrets:", f.read(), re.S).group(1)
    args = build_parser().parse_args(command.split()[1:])
    host = args.http.rpartition(":")[0]
    assert host == "0.0.0.0" and args.http_token_file and args.http_tls_cert and args.http_tls_key
    web.check_exposure(host, "a token", args.http_tls_cert)  # what `fleet run` checks before serving
    with pytest.raises(ValueError):
        web.check_exposure(host, None, args.http_tls_cert)


LONG_REASON = ("service down: 127.0.0.1:50051: UNAVAILABLE failed to connect to all addresses; last error: "
               "UNKNOWN: ipv4:127.0.0.1:50051: Failed to connect to remote host: connect: Connection refused (111)")


def test_page_fits_1280_px_with_long_reasons(registry, serve, tmp_path):
    """A laptop's 1280×900 window in real Chromium, scrollbars drawn: a long reason wraps (cut
    past REASON_CHARS, whole in the cell's tooltip) instead of pushing JetPack and Last seen off
    screen. A horizontal scrollbar is the strip of non-white pixels at the bottom of the window."""
    from PIL import Image

    now = time.time()
    registry.state("lab", "orin-nano-kiosk-lobby-07", {"online": True, "bdSeq": 1, "interval": 10.0,
                                                       "versions": {"jetpack": "6.2"}}, now=now - 20)
    registry.data("lab", "orin-nano-kiosk-lobby-07", "health",
                  health(1, status="DEGRADED", reasons=[LONG_REASON * 2, "cpu 95 C"]), now=now - 5)
    url = serve() + "/"
    binary = require_tool("chromium")
    shot = tmp_path / "fleet-1280.png"
    out = subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--user-data-dir=%s" % (tmp_path / "p"),
                          "--window-size=1280,900", "--screenshot=%s" % shot, url],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 900)
    width, height = image.size
    bottom = [image.getpixel((x, y)) for y in range(height - 16, height) for x in range(0, width, 4)]
    assert all(pixel == (255, 255, 255) for pixel in bottom), "a horizontal scrollbar: the page is wider than 1280 px"
    _, _, body = get(url)
    assert LONG_REASON[:40] in body.decode() and "…" in body.decode()
    assert html_title_has(body.decode(), LONG_REASON * 2), "the cut reason is whole in the tooltip"


def html_title_has(page, text):
    import html as html_module

    return any(text in html_module.unescape(t) for t in re.findall(r"title='([^']*)'", page))
