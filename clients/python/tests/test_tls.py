"""TLS, mutual TLS and bearer tokens of dsa_client against an in-process gRPC server on a free
loopback port: a CA, a server and a client certificate (and a second, untrusted CA) made with the
openssl CLI in a temporary folder, the server's port serving TLS and an interceptor that refuses
calls without the right "authorization: Bearer" (as the coordinator's --auth-tokens-file does).
It shows the token reaches the server over TLS only, and what a plaintext, wrong-CA,
wrong-name, certificate-less or token-less client sees (docs/deploy.md, "TLS, mutual TLS and
bearer tokens"). Skipped where there is no openssl."""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from concurrent import futures

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsa_client import CoordinatorClient, tls_credentials  # noqa: E402
from dsa_client.client import (HEALTH_CHECK_METHOD, HealthCheckRequest,  # noqa: E402
                               HealthCheckResponse)

SERVER_NAME = "dsa-coordinator.test"  # the only name in the server's certificate
TOKEN = "s3cret-token"


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(folder, name):
    """A self-signed P-256 CA: <name>.crt and <name>.key in folder."""
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "1", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)


def _make_leaf(folder, name, ca, common_name, extensions):
    """<name>.crt / <name>.key: a P-256 certificate of common_name signed by ca, with extensions
    (an openssl extension file's lines)."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={common_name}",
             cwd=folder)
    with open(os.path.join(folder, f"{name}.ext"), "w", encoding="utf-8") as f:
        f.write("\n".join(["basicConstraints=CA:FALSE", *extensions]) + "\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", "1",
             "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=folder)


class _RequireBearerToken(grpc.ServerInterceptor):
    """Refuses every call whose authorization metadata is not "Bearer TOKEN" with
    UNAUTHENTICATED, the coordinator's messages."""

    def __init__(self, token):
        self._expected = f"Bearer {token}"

    def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        got = metadata.get("authorization")
        if got == self._expected:
            return continuation(handler_call_details)
        message = "missing bearer token" if got is None else "unknown bearer token"

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        return grpc.unary_unary_rpc_method_handler(refuse)


class _Server:
    """A health-only gRPC server on 127.0.0.1:0 whose port serves TLS with the test PKI's server
    certificate (client certificates required with `mutual`), tokens checked when `token` is set.
    `seen` records, per call answered, the authorization metadata and the transport security."""

    def __init__(self, pki, *, mutual=False, token=None):
        self.seen = []
        interceptors = [_RequireBearerToken(token)] if token else []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                  interceptors=interceptors)
        _, service, method = HEALTH_CHECK_METHOD.split("/")
        handler = grpc.unary_unary_rpc_method_handler(
            self._check, request_deserializer=HealthCheckRequest.FromString,
            response_serializer=HealthCheckResponse.SerializeToString)
        self.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(service, {method: handler})])
        credentials = grpc.ssl_server_credentials(
            [(pki.read("server.key"), pki.read("server.crt"))],
            root_certificates=pki.read("ca.crt") if mutual else None, require_client_auth=mutual)
        self.port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.target = f"127.0.0.1:{self.port}"
        self.server.start()

    def _check(self, request, context):
        auth = context.auth_context()
        self.seen.append({
            "authorization": dict(context.invocation_metadata()).get("authorization"),
            "transport": b"".join(auth.get("transport_security_type", [])).decode(),
            "client_common_name": b"".join(auth.get("x509_common_name", [])).decode()})
        return HealthCheckResponse(status=1)

    def stop(self):
        self.server.stop(grace=None)


class _Pki:
    """The test's certificates, in a temporary folder that lives as long as the test class."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="dsa-client-tls-")
        _make_ca(self.folder, "ca")
        _make_ca(self.folder, "other-ca")
        _make_leaf(self.folder, "server", "ca", "dsa-coordinator",
                   [f"subjectAltName=DNS:{SERVER_NAME}", "extendedKeyUsage=serverAuth"])
        _make_leaf(self.folder, "client", "ca", "router-1", ["extendedKeyUsage=clientAuth"])

    def path(self, name):
        return os.path.join(self.folder, name)

    def read(self, name):
        with open(self.path(name), "rb") as f:
            return f.read()

    def remove(self):
        shutil.rmtree(self.folder, ignore_errors=True)


@unittest.skipUnless(shutil.which("openssl"), "needs the openssl CLI")
class TlsAndTokenTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pki = _Pki()

    @classmethod
    def tearDownClass(cls):
        cls.pki.remove()

    def setUp(self):
        self.servers = []

    def tearDown(self):
        for server in self.servers:
            server.stop()

    def serve(self, **kwargs):
        server = _Server(self.pki, **kwargs)
        self.servers.append(server)
        return server

    def health_code(self, server, **connect):
        """The status code of one health check, OK included."""
        try:
            with CoordinatorClient.connect(server.target, **connect) as client:
                client.health("", timeout_s=5.0)
            return grpc.StatusCode.OK
        except grpc.RpcError as error:
            return error.code()

    def test_the_token_is_sent_over_tls(self):
        server = self.serve(token=TOKEN)
        credentials = tls_credentials(ca_file=self.pki.path("ca.crt"))
        with CoordinatorClient.connect(server.target, credentials=credentials, token=TOKEN,
                                       server_name=SERVER_NAME) as client:
            self.assertEqual(client.health("readiness"), "SERVING")
        self.assertEqual(server.seen, [{"authorization": f"Bearer {TOKEN}", "transport": "ssl",
                                        "client_common_name": ""}])

    def test_a_missing_or_wrong_token_is_unauthenticated(self):
        server = self.serve(token=TOKEN)
        credentials = tls_credentials(ca_file=self.pki.path("ca.crt"))
        for token in (None, "not-the-token"):
            with self.subTest(token=token):
                with self.assertRaises(grpc.RpcError) as raised:
                    with CoordinatorClient.connect(server.target, credentials=credentials,
                                                   token=token, server_name=SERVER_NAME) as client:
                        client.health("readiness", timeout_s=5.0)
                self.assertEqual(raised.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
                expected = "missing bearer token" if token is None else "unknown bearer token"
                self.assertEqual(raised.exception.details(), expected)
        self.assertEqual(server.seen, [])

    def test_a_token_without_tls_is_refused_before_dialing(self):
        for kwargs in ({}, {"options": [("grpc.primary_user_agent", "x")]}):
            with self.assertRaisesRegex(ValueError, "tokens must not cross plaintext"):
                CoordinatorClient.connect("127.0.0.1:1", token=TOKEN, **kwargs)
        with self.assertRaisesRegex(ValueError, "one word"):
            CoordinatorClient.connect("127.0.0.1:1", credentials=tls_credentials(),
                                      token="two words")
        with self.assertRaisesRegex(ValueError, "one word"):
            CoordinatorClient.connect("127.0.0.1:1", credentials=tls_credentials(), token="")
        with self.assertRaisesRegex(ValueError, "server_name needs TLS"):
            CoordinatorClient.connect("127.0.0.1:1", server_name=SERVER_NAME)

    def test_plaintext_wrong_ca_and_wrong_name_fail_the_handshake(self):
        server = self.serve()
        cases = {
            "plaintext": {},
            "another CA": {"credentials": tls_credentials(ca_file=self.pki.path("other-ca.crt")),
                           "server_name": SERVER_NAME},
            "the system's roots": {"credentials": tls_credentials(), "server_name": SERVER_NAME},
            "a name not in the certificate": {
                "credentials": tls_credentials(ca_file=self.pki.path("ca.crt"))},
        }
        for name, connect in cases.items():
            with self.subTest(name):
                self.assertEqual(self.health_code(server, **connect), grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(server.seen, [])
        self.assertEqual(self.health_code(server, root_certificates=self.pki.read("ca.crt"),
                                          server_name=SERVER_NAME), grpc.StatusCode.OK)

    def test_mutual_tls_needs_a_client_certificate_of_the_ca(self):
        server = self.serve(mutual=True, token=TOKEN)
        without = tls_credentials(ca_file=self.pki.path("ca.crt"))
        self.assertEqual(self.health_code(server, credentials=without, token=TOKEN,
                                          server_name=SERVER_NAME), grpc.StatusCode.UNAVAILABLE)
        with_cert = tls_credentials(ca_file=self.pki.path("ca.crt"),
                                    cert_file=self.pki.path("client.crt"),
                                    key_file=self.pki.path("client.key"))
        self.assertEqual(self.health_code(server, credentials=with_cert, token=TOKEN,
                                          server_name=SERVER_NAME), grpc.StatusCode.OK)
        self.assertEqual(server.seen, [{"authorization": f"Bearer {TOKEN}", "transport": "ssl",
                                        "client_common_name": "router-1"}])

    def test_tls_credentials_checks_its_files(self):
        with self.assertRaisesRegex(ValueError, "go together"):
            tls_credentials(ca_file=self.pki.path("ca.crt"), cert_file=self.pki.path("client.crt"))
        with self.assertRaisesRegex(ValueError, "go together"):
            tls_credentials(key_file=self.pki.path("client.key"))
        with self.assertRaises(FileNotFoundError):
            tls_credentials(ca_file=self.pki.path("missing.crt"))
        with self.assertRaisesRegex(ValueError, "no PEM block"):
            tls_credentials(ca_file=self.pki.path("server.ext"))


if __name__ == "__main__":
    unittest.main()
