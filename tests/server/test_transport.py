"""TLS with client certificates (mTLS) on TCP, and the plain Unix-socket listener for local clients."""

import subprocess

import grpc
import pytest

from tests.server.conftest import LiveServer, engine_factory, greedy
from tests.tools import require_tool
from jetserve.v1 import inference_pb2 as pb
from jetserve.v1 import inference_pb2_grpc as pb_grpc



@pytest.fixture(autouse=True)
def openssl():
    """openssl makes the test certificates."""
    return require_tool("openssl")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(name, subject, ca_dir, extensions=None):
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", name + ".key", "-out", name + ".csr", "-subj", subject, cwd=ca_dir)
    args = ["x509", "-req", "-in", name + ".csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "1", "-out", name + ".pem"]
    if extensions:
        (ca_dir / (name + ".ext")).write_text(extensions)
        args += ["-extfile", name + ".ext"]
    _openssl(*args, cwd=ca_dir)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    path = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=jetserve test CA", cwd=path)
    _issue("server", "/CN=localhost", path, "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _issue("client", "/CN=kiosk-7", path)
    return path


@pytest.fixture(scope="module")
def secured(tiny_model, pki, tmp_path_factory):
    socket_path = tmp_path_factory.mktemp("run") / "jetserve.sock"
    server = LiveServer(engine_factory(tiny_model), tls_cert=str(pki / "server.pem"),
                        tls_key=str(pki / "server.key"), tls_client_ca=str(pki / "ca.pem"),
                        unix_socket=str(socket_path))
    server.wait_loaded()
    server.socket_path = socket_path
    yield server
    server.stop()


def _generate(channel):
    request = pb.GenerateRequest(text="kiosk", sampling=greedy(3, ignore_eos=True))
    return list(pb_grpc.InferenceServiceStub(channel).Generate(request, timeout=10))


def _credentials(pki, client_cert=True):
    read = lambda name: (pki / name).read_bytes()  # noqa: E731
    if client_cert:
        return grpc.ssl_channel_credentials(read("ca.pem"), read("client.key"), read("client.pem"))
    return grpc.ssl_channel_credentials(read("ca.pem"))


def test_mtls_client_with_a_certificate_is_served(secured, pki):
    with grpc.secure_channel(secured.target, _credentials(pki)) as channel:
        assert _generate(channel)[-1].usage.completion_tokens == 3


@pytest.mark.parametrize("how", ["no client certificate", "plaintext"])
def test_clients_without_a_certificate_are_refused(secured, pki, how):
    channel = (grpc.secure_channel(secured.target, _credentials(pki, client_cert=False))
               if how == "no client certificate" else grpc.insecure_channel(secured.target))
    with channel, pytest.raises(grpc.RpcError) as err:
        _generate(channel)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_unix_socket_serves_local_clients(secured):
    with grpc.insecure_channel("unix:" + str(secured.socket_path)) as channel:
        assert _generate(channel)[-1].usage.completion_tokens == 3
