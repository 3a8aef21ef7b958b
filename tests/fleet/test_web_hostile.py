"""The fleet page and API against what a hostile (or broken) device can report and what a
demanding operator can ask: real registries (SQLite and PostgreSQL), a real uvicorn, the page in
a real headless Chromium. Device documents go through the wire's own checks first, so each one
here is something a device can really get stored (but one: a document stored before the wire
refused what it holds)."""

import html
import json
import re
import sqlite3
import subprocess
import time
import urllib.request

import pytest

from jetserve.fleet import web
from jetserve.fleet.registry import Registry
from jetserve.wire.messages import MAX_ITEMS, MAX_NAME, Alert, Birth, Health, parse
from tests.fleet.test_registry import health
from tests.fleet.test_web import get
from tests.tools import require_module, require_tool

SECURITY = ("Content-Security-Policy", "X-Content-Type-Options", "X-Frame-Options", "Referrer-Policy", "Cache-Control")


def birth(jetpack="6.2"):
    return parse(Birth, json.dumps({"online": True, "bdSeq": 1, "interval": 10.0, "keepalive": 30,
                                    "versions": {"jetpack": jetpack}, "compat": {"status": "ok", "checks": []}})
                 .encode()).doc


def health_doc(n, reasons, status="DEGRADED"):
    """A health document as a device sends it (JSON text, so "\\ud800" escapes are the device's)."""
    return json.dumps(health(n, status=status, schema=1, ts=time.time(), probe={}, reasons=reasons))


def checked_health(text):
    return parse(Health, text.encode()).doc


@pytest.fixture
def serve():
    servers = []

    def start(registry, **kwargs):
        servers.append(web.Server(registry, "127.0.0.1", 0, **kwargs))
        return "http://127.0.0.1:%d" % servers[-1].address[1]

    yield start
    for server in servers:
        server.stop()


def chromium(profile, *args):
    binary = require_tool("chromium")
    out = subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--user-data-dir=%s" % profile]
                         + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    return out.stdout.decode()


def test_a_lone_surrogate_from_one_device_breaks_neither_the_page_nor_the_api(registry_location, serve, tmp_path):
    """JSON lets a device write "\\ud800" (half of a UTF-16 pair), and UTF-8 has no bytes for it:
    the wire refuses it now (test_poison), but a registry may hold one stored before, with which
    the page and every API answer failed with a 500 for every operator. It is shown as U+FFFD and
    the answers are strict UTF-8 JSON."""
    r = Registry(registry_location)
    try:
        r.state("lab", "good", birth())
        r.data("lab", "good", "health", checked_health(health_doc(1, ["cpu 95 C"])))
        r.state("lab", "evil", birth())
        stored_before = json.loads(health_doc(1, ["x"]).replace('"x"', '"<b>\\ud800</b>"'))  # past the wire's check
        r.data("lab", "evil", "health", stored_before)
        base = serve(r)
        for path in ("/api/devices", "/api/devices/lab/evil", "/api/alerts"):
            status, headers, body = get(base + path)
            assert status == 200 and headers["Content-Type"] == "application/json", (path, status, body[:300])
            json.loads(body.decode("utf-8"))  # strict UTF-8, valid JSON
        devices = {d["device"]: d for d in json.loads(get(base + "/api/devices")[2])["devices"]}
        assert devices["evil"]["reasons"] == ["<b>\ufffd</b>"] and devices["good"]["reasons"] == ["cpu 95 C"]
        status, _, body = get(base + "/")
        assert status == 200 and "&lt;b&gt;\ufffd&lt;/b&gt;" in body.decode("utf-8")
        dom = chromium(tmp_path / "profile", "--dump-dom", base + "/")
        assert "<td>good</td>" in dom and "<td>evil</td>" in dom and "<b>" not in dom
    finally:
        r.close()


def test_pager_keeps_the_fleet_and_leads_back_from_past_the_end(serve, tmp_path):
    """Paging one fleet's devices: "next" led to the next page of every fleet (the fleet was left
    out of the link), and "previous" from past the end led to another empty page."""
    r = Registry(str(tmp_path / "fleet.db"))
    for fleet in ("lab", "other"):
        for i in range(3):
            r.state(fleet, "%s-%d" % (fleet, i), birth())
    base = serve(r)
    dom = chromium(tmp_path / "p1", "--dump-dom", base + "/?fleet=lab&limit=2")
    links = {html.unescape(label): html.unescape(href) for href, label in re.findall(r'<a href="([^"]*)">([^<]*)</a>', dom)}
    assert links == {"next →": "/?fleet=lab&offset=2&limit=2"}, links
    dom = chromium(tmp_path / "p2", "--dump-dom", base + links["next →"])
    assert re.findall(r"<tr><td>(\w+)</td><td>([\w-]+)</td>", dom) == [("lab", "lab-2")]
    dom = chromium(tmp_path / "p3", "--dump-dom", base + "/?fleet=lab&offset=40&limit=2")
    links = {html.unescape(label): html.unescape(href) for href, label in re.findall(r'<a href="([^"]*)">([^<]*)</a>', dom)}
    assert links == {"← previous": "/?fleet=lab&offset=2&limit=2"}, links
    r.close()


def test_page_fits_1280_px_with_the_longest_names_and_versions_allowed(serve, tmp_path):
    """Fleet and device names, versions and alert kinds may each be 64 characters without a
    space (what the wire and the topics take): they wrap instead of making the page wider than a
    laptop's 1280-pixel window (a horizontal scrollbar: non-white pixels along the bottom)."""
    from PIL import Image

    fleet, device = "F" * 64, "D" * 64
    r = Registry(str(tmp_path / "fleet.db"))
    r.state(fleet, device, birth(jetpack="J" * MAX_NAME))
    r.data(fleet, device, "health", checked_health(health_doc(1, ["cpu 95 C"])))
    r.data(fleet, device, "alert", parse(Alert, json.dumps({"epoch": "e1", "n": 2, "seq": 2, "type": "K" * MAX_NAME,
                                                            "ts": time.time()}).encode()).doc)
    shot = tmp_path / "wide.png"
    chromium(tmp_path / "p", "--window-size=1280,900", "--screenshot=%s" % shot, serve(r) + "/")
    image = Image.open(shot).convert("RGB")
    width, height = image.size
    bottom = [image.getpixel((x, y)) for y in range(height - 16, height) for x in range(0, width - 20, 4)]
    assert all(pixel == (255, 255, 255) for pixel in bottom), "a horizontal scrollbar: the page is wider than 1280 px"
    r.close()


def test_a_device_with_hundreds_of_reasons_keeps_to_its_row(serve, tmp_path):
    """A device may send up to MAX_ITEMS reasons: its cell showed every one (a row thousands of
    pixels tall, every other device pushed off the screen). It shows the first REASONS_SHOWN and
    how many more; the tooltip and the API keep them all. Each reason is isolated, so a
    right-to-left override in one does not reverse the next."""
    reasons = ["\u202ereason %03d" % i for i in range(MAX_ITEMS)]
    r = Registry(str(tmp_path / "fleet.db"))
    r.state("lab", "chatty", birth())
    r.data("lab", "chatty", "health", checked_health(health_doc(1, reasons)))
    base = serve(r)
    dom = chromium(tmp_path / "p", "--dump-dom", base + "/")
    cell = re.search(r'<td class="text" title="([^"]*)">(.*?)</td>', dom)
    assert html.unescape(cell.group(1)) == "; ".join(reasons), "the tooltip has them all"
    shown = re.findall(r"<bdi>(.*?)</bdi>", cell.group(2))
    assert shown == reasons[:web.REASONS_SHOWN], cell.group(2)[:500]
    assert cell.group(2).endswith("; and %d more" % (MAX_ITEMS - web.REASONS_SHOWN))
    assert json.loads(get(base + "/api/devices")[2])["devices"][0]["reasons"] == reasons
    r.close()


def test_query_parameters_unknown_or_repeated_are_refused_by_name(serve, tmp_path):
    """`?ofset=200` silently showed the first page, and `?fleet=a&fleet=b` silently showed one of
    them; both are a 400 naming the parameter now, before anything is read."""
    r = Registry(str(tmp_path / "fleet.db"))
    r.state("lab", "d", birth())
    base = serve(r)
    for query, detail in (("/?ofset=200", "ofset: not a parameter of / (it takes fleet, offset, limit)"),
                          ("/api/devices?fleet=lab&fleet=other", "fleet: given more than once"),
                          ("/api/devices?limit=1&limit=99999", "limit: given more than once"),
                          ("/api/alerts?devices=d", "devices: not a parameter of /api/alerts (it takes fleet, device, "
                                                    "limit)"),
                          ("/api/devices/lab/d?x=" + "y" * 10000, "x: not a parameter of /api/devices/lab/d (it takes "
                                                                  "none)"),
                          ("/?" + "k" * 5000 + "=1", "k" * 64 + ": not a parameter of / (it takes fleet, offset, "
                                                                "limit)")):
        status, headers, body = get(base + query)
        assert status == 400 and json.loads(body) == {"detail": detail}, (query[:80], status, body[:200])
        assert headers["Content-Security-Policy"]
    assert get(base + "/api/devices?fleet=lab&offset=0&limit=5")[0] == 200
    r.close()


def test_head_is_answered_like_get_without_a_body(serve, tmp_path):
    """HTTP has every server answer HEAD as GET (`curl -I`, uptime monitors): it was a 405."""
    r = Registry(str(tmp_path / "fleet.db"))
    base = serve(r, token="t0k-" + "x" * 28)
    for path, kind in (("/", "text/html; charset=utf-8"), ("/api/devices", "application/json"),
                       ("/api/alerts", "application/json")):
        request = urllib.request.Request(base + path, method="HEAD",
                                         headers={"Authorization": "Bearer t0k-" + "x" * 28})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200 and response.headers["Content-Type"] == kind, path
            assert response.read() == b"" and all(response.headers[h] for h in SECURITY)
    request = urllib.request.Request(base + "/", method="HEAD")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 401, "HEAD needs the token as GET does"
    r.close()


def test_a_registry_that_cannot_be_read_is_a_503_and_a_broken_row_a_500_both_with_the_headers(
        serve, tmp_path, postgres_url):
    """The database gone for a moment (here: PostgreSQL ends the controller's sessions) was a bare
    "500 Internal Server Error" in text; now a JSON 503 saying to try again, and the next request
    reconnects. A stored document that cannot be read (a damaged row) is a JSON 500 without a
    traceback. Every answer carries the security headers the page promises, these included."""
    psycopg = require_module("psycopg")
    r = Registry(postgres_url)
    r.state("lab", "d", birth())
    base = serve(r)
    assert get(base + "/api/devices")[0] == 200
    name = psycopg.conninfo.conninfo_to_dict(postgres_url)["dbname"]
    with psycopg.connect(postgres_url.replace("/%s?" % name, "/postgres?"), autocommit=True) as admin:
        # Each returns once its backend has gone (the signal alone would race the next request).
        admin.execute("SELECT pg_terminate_backend(pid, 30000) FROM pg_stat_activity WHERE datname = %s "
                      "AND pid <> pg_backend_pid()", (name,))
    status, headers, body = get(base + "/api/devices")
    assert status == 503 and headers["Content-Type"] == "application/json" and headers["Retry-After"], body
    assert "try again" in json.loads(body)["detail"] and all(headers[h] for h in SECURITY)
    assert get(base + "/api/devices")[0] == 200, "the next request reconnects"
    r.close()

    path = str(tmp_path / "fleet.db")
    r = Registry(path)
    r.state("lab", "d", birth())
    with sqlite3.connect(path) as db:
        db.execute("UPDATE devices SET health = '{damaged'")
    base = serve(r)
    for page in ("/", "/api/devices"):
        status, headers, body = get(base + page)
        assert status == 500 and headers["Content-Type"] == "application/json", (page, status, body)
        assert "log" in json.loads(body)["detail"] and b"Traceback" not in body and b"damaged" not in body
        assert all(headers[h] for h in SECURITY), page
    r.close()
