"""TLS and mutual TLS: certificates made here with the openssl command (a CA, the server's
for 127.0.0.1, a client's), a real server and real gRPC and HTTPS clients."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from http import client as http_client
from pathlib import Path

import grpc
import pytest

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl command")


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tls")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.pem", cwd=folder)  # fmt: skip
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=folder)  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", "san.ext",
                "-out", f"{name}.pem", cwd=folder)  # fmt: skip
    return folder


def generate(channel: grpc.Channel) -> pb.GenerateResponse:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(max_tokens=4)
    )
    return pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=30)


def https_completion(port: int, context: ssl.SSLContext | None, scheme: str = "https") -> dict:
    request = urllib.request.Request(
        f"{scheme}://127.0.0.1:{port}/v1/completions",
        data=json.dumps({"prompt": [5, 6, 7], "max_tokens": 4}).encode(),
    )
    with urllib.request.urlopen(request, timeout=30, context=context) as response:
        return json.loads(response.read())


def test_mutual_tls_serves_clients_with_a_certificate_and_refuses_others(
    start_server, certificates
):
    files = {name: str(certificates / name) for name in ("ca.pem", "server.pem", "server.key")}
    server = start_server(
        "--tls-cert-file", files["server.pem"], "--tls-key-file", files["server.key"],
        "--tls-client-ca-file", files["ca.pem"], "--http-port", "0",
    )  # fmt: skip
    target = f"127.0.0.1:{server.port}"
    ca = (certificates / "ca.pem").read_bytes()
    with_certificate = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=(certificates / "client.key").read_bytes(),
        certificate_chain=(certificates / "client.pem").read_bytes(),
    )
    with grpc.secure_channel(target, with_certificate) as channel:
        assert generate(channel).finished
    for channel in (
        grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca)),
        grpc.insecure_channel(target),
    ):
        with channel, pytest.raises(grpc.RpcError) as caught:
            generate(channel)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    # The HTTP API takes the same files: HTTPS with a client certificate, nothing else.
    context = ssl.create_default_context(cafile=files["ca.pem"])
    without_certificate = ssl.create_default_context(cafile=files["ca.pem"])
    context.load_cert_chain(str(certificates / "client.pem"), str(certificates / "client.key"))
    assert https_completion(server.http_port, context)["usage"]["completion_tokens"] == 4
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        https_completion(server.http_port, without_certificate)
    with pytest.raises((urllib.error.URLError, ConnectionError, http_client.HTTPException)):
        https_completion(server.http_port, None, scheme="http")
    assert server.terminate() == 0


def test_tls_files_must_come_in_pairs_and_exist(start_server, certificates):
    server = start_server("--tls-cert-file", str(certificates / "server.pem"), wait=False)
    assert server.process.wait(60) == 2
    assert "tls_cert_file and tls_key_file go together" in server.log()
    server = start_server(
        "--tls-cert-file", str(certificates / "server.pem"),
        "--tls-key-file", str(certificates / "missing.key"), wait=False,
    )  # fmt: skip
    assert server.process.wait(60) == 2
    assert "tls_key_file:" in server.log() and "is not a readable file" in server.log()
