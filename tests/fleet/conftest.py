"""The fleet tests use the same real broker, service and process fixtures as the agent's, plus a
broker configured as deploy/ ships it and a real PostgreSQL server (`.ci/run` starts one and
names it in $JETSERVE_TEST_POSTGRES)."""

import getpass
import os
import shutil
import subprocess
import time
import uuid

import pytest

from tests.agent.conftest import REPO, Broker, broker, free_port, service, spawn  # noqa: F401  (fixtures)
from tests.tools import missing, require_module, require_tool

ACCOUNTS = {"jetserve-fleet": ("controller", "jetserve-fleet"), "lab/dev-a": ("device", "lab", "dev-a"),
            "lab/dev-b": ("device", "lab", "dev-b"), "other/dev-c": ("device", "other", "dev-c")}


def add_user(directory, *args):
    return subprocess.run(["sh", os.path.join(REPO, "deploy/add-user.sh"), "-d", str(directory)] + list(args),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)


def shipped_conf(directory, port, tls_port):
    """deploy/mosquitto.conf as shipped, line for line, with its files in `directory`, its log in a
    file and its two listeners on free loopback ports (the TLS one with a self-signed certificate)."""
    directory = str(directory)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", os.path.join(directory, "server.key"), "-out", os.path.join(directory, "server.crt")],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    with open(os.path.join(REPO, "deploy/mosquitto.conf")) as f:
        text = f.read()
    for shipped, ours in (("/mosquitto/config", directory), ("/mosquitto/data", directory),
                          ("log_dest stdout", "log_dest file %s/mosquitto.log" % directory),
                          ("listener 1883 127.0.0.1", "listener %d 127.0.0.1" % port),
                          ("listener 8883", "listener %d 127.0.0.1" % tls_port)):
        assert shipped in text, shipped
        text = text.replace(shipped, ours)
    if os.geteuid() == 0:  # as root mosquitto would become `mosquitto`, who cannot read pytest's tmp dirs
        text += "user %s\n" % getpass.getuser()
    return text


@pytest.fixture
def shipped_broker(tmp_path):
    """mosquitto run on deploy/'s own configuration and ACL, accounts (password "pw-" + name) made
    by add-user.sh; `.tls_port` is the devices' listener."""
    require_tool("mosquitto_passwd", "openssl")
    shutil.copy(os.path.join(REPO, "deploy/acl"), str(tmp_path / "acl"))
    for name, args in ACCOUNTS.items():
        out = add_user(tmp_path, *(args + ("pw-" + name,)))
        assert out.returncode == 0, out.stdout.decode()
    running = Broker(tmp_path)
    running.tls_port = free_port()
    with open(running.conf, "w") as f:
        f.write(shipped_conf(tmp_path, running.port, running.tls_port))
    running.start()
    yield running
    running.stop()


@pytest.fixture
def postgres_url():
    """A fresh database on the server named by $JETSERVE_TEST_POSTGRES, dropped afterwards."""
    server = os.environ.get("JETSERVE_TEST_POSTGRES")
    if not server:
        missing("a PostgreSQL server", "set JETSERVE_TEST_POSTGRES; bash .ci/run starts one")
    psycopg = require_module("psycopg")
    name = "jetserve_test_" + uuid.uuid4().hex[:12]
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute("CREATE DATABASE %s" % name)
    conninfo = psycopg.conninfo.conninfo_to_dict(server)
    conninfo.pop("dbname", None)
    yield "postgresql:///%s?%s" % (name, "&".join("%s=%s" % item for item in conninfo.items()))
    with psycopg.connect(server, autocommit=True) as admin:
        # FORCE ends our own sessions, not an autovacuum worker's (a superuser's, on the fresh
        # tables): that one finishes within milliseconds, so try again a bounded number of times.
        for _ in range(100):
            try:
                admin.execute("DROP DATABASE %s WITH (FORCE)" % name)
                return
            except psycopg.errors.InsufficientPrivilege:
                time.sleep(0.1)
        admin.execute("DROP DATABASE %s WITH (FORCE)" % name)  # still held: fail with the server's reason


@pytest.fixture(params=["sqlite", "postgresql"])
def registry_location(request, tmp_path):
    """Where a registry lives: an SQLite file, or a PostgreSQL database (the same rules hold)."""
    if request.param == "sqlite":
        return str(tmp_path / "fleet.db")
    return request.getfixturevalue("postgres_url")
