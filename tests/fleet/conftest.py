"""The fleet tests use the same real broker, service and process fixtures as the agent's, plus a
broker configured as deploy/ ships it and a real PostgreSQL server (`.ci/run` starts one and
names it in $JETSERVE_TEST_POSTGRES)."""

import os
import shutil
import subprocess
import uuid

import pytest

from tests.agent.conftest import REPO, Broker, broker, service, spawn  # noqa: F401  (pytest fixtures)

# Settings that belong to the host, not to the policy: the tests put their own in their place.
HOST_SETTINGS = ("listener", "certfile", "keyfile", "persistence", "persistence_location", "log_dest")
ACCOUNTS = {"jetserve-fleet": ("controller", "jetserve-fleet"), "lab/dev-a": ("device", "lab", "dev-a"),
            "lab/dev-b": ("device", "lab", "dev-b"), "other/dev-c": ("device", "other", "dev-c")}


def add_user(directory, *args):
    return subprocess.run(["sh", os.path.join(REPO, "deploy/add-user.sh"), "-d", str(directory)] + list(args),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)


def shipped_settings(directory):
    """deploy/mosquitto.conf as shipped, its files in `directory`, less the host's settings."""
    with open(os.path.join(REPO, "deploy/mosquitto.conf")) as f:
        lines = [line for line in f if line.strip() and not line.startswith("#")
                 and line.split()[0] not in HOST_SETTINGS]
    return "".join(lines).replace("/mosquitto/config", str(directory))


@pytest.fixture
def shipped_broker(tmp_path):
    """mosquitto with deploy/'s settings and ACL; accounts (password "pw-" + name) by add-user.sh."""
    if not shutil.which("mosquitto_passwd"):
        pytest.skip("mosquitto_passwd is not installed")
    shutil.copy(os.path.join(REPO, "deploy/acl"), str(tmp_path / "acl"))
    for name, args in ACCOUNTS.items():
        out = add_user(tmp_path, *(args + ("pw-" + name,)))
        assert out.returncode == 0, out.stdout.decode()
    running = Broker(tmp_path, shipped_settings(tmp_path)).start()
    yield running
    running.stop()


@pytest.fixture
def postgres_url():
    """A fresh database on the server named by $JETSERVE_TEST_POSTGRES, dropped afterwards."""
    server = os.environ.get("JETSERVE_TEST_POSTGRES")
    if not server:
        pytest.skip("no PostgreSQL server: set JETSERVE_TEST_POSTGRES (bash .ci/run starts one)")
    psycopg = pytest.importorskip("psycopg")
    name = "jetserve_test_" + uuid.uuid4().hex[:12]
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute("CREATE DATABASE %s" % name)
    conninfo = psycopg.conninfo.conninfo_to_dict(server)
    conninfo.pop("dbname", None)
    yield "postgresql:///%s?%s" % (name, "&".join("%s=%s" % item for item in conninfo.items()))
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute("DROP DATABASE %s WITH (FORCE)" % name)


@pytest.fixture(params=["sqlite", "postgresql"])
def registry_location(request, tmp_path):
    """Where a registry lives: an SQLite file, or a PostgreSQL database (the same rules hold)."""
    if request.param == "sqlite":
        return str(tmp_path / "fleet.db")
    return request.getfixturevalue("postgres_url")
