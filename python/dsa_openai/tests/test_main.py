"""python -m dsa_openai as a process, as the chart runs it: over mutual TLS to a scripted
coordinator with its own token from a file, its refusals of bad flags and files, and its drain on
SIGTERM (requests in flight run on for --shutdown-grace-s, then are cancelled). The tokenizer is a
small word-level one with SmolLM2's special tokens at their ids (no model files needed)."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import List, Optional

import grpc
import pytest

from dsa_client.proto.dsa.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dsa_model.config import SPECIAL_TOKENS

WORDS = ["hello", "world", "user", "assistant", "system", "\n"]
TOKEN = "front-token"


def write_tokenizer(folder: Path) -> int:
    """A word-level tokenizer.json with the special tokens at ids 0..16; returns its vocab size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, "[UNK]", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return len(vocab)


def make_certificates(folder: Path) -> None:
    """ca.crt, and server and client pairs it signs (the server's for 127.0.0.1 and localhost)."""
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "2", "-subj", "/CN=test-ca")
    for name, extension in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
                            ("client", "extendedKeyUsage=clientAuth")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        (folder / f"{name}.ext").write_text(extension + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")


class Coordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """GetLoad serves a model of `vocab` tokens; each Generate streams `reply` (token 17 repeated)
    one token every `step_s`, recording the calls' metadata and cancellations."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.step_s = 0.0
        self.get_load_metadata: List[dict] = []
        self.cancelled = 0
        self.completed = 0

    async def GetLoad(self, request, context):
        self.get_load_metadata.append(dict(context.invocation_metadata()))
        return coordinator_pb2.GetLoadResponse(model=coordinator_pb2.Model(
            name="word-model", vocab_size=self.vocab, eos_token_id=0, max_context=256))

    async def Generate(self, request, context):
        yield coordinator_pb2.GenerateEvent(admitted=coordinator_pb2.Admitted())
        try:
            for n in range(request.max_new_tokens):
                await asyncio.sleep(self.step_s)
                yield coordinator_pb2.GenerateEvent(tokens=coordinator_pb2.Tokens(
                    first_position=len(request.context_tokens.tokens) + n, count=1,
                    token_ids=[len(SPECIAL_TOKENS) + 1]))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.completed += 1
        yield coordinator_pb2.GenerateEvent(finished=coordinator_pb2.Finished(
            generated_tokens=request.max_new_tokens, finish_reason=coordinator_pb2.FINISH_REASON_LENGTH))


class Server:
    """The scripted coordinator on a mutual-TLS port, on an event loop of its own thread."""

    def __init__(self, certs: Path, vocab: int):
        self.coordinator = Coordinator(vocab)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def start():
            self.server = grpc.aio.server()
            coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(self.coordinator, self.server)
            credentials = grpc.ssl_server_credentials(
                [((certs / "server.key").read_bytes(), (certs / "server.crt").read_bytes())],
                root_certificates=(certs / "ca.crt").read_bytes(), require_client_auth=True)
            self.port = self.server.add_secure_port("127.0.0.1:0", credentials)
            await self.server.start()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(30)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("front")
    vocab = write_tokenizer(folder)
    make_certificates(folder)
    (folder / "token").write_text(TOKEN + "\n")
    server = Server(folder, vocab)
    yield folder, server
    server.close()


def front_args(folder: Path, server: Server, port: int, *extra: str) -> List[str]:
    return [sys.executable, "-m", "dsa_openai", "--coordinator", f"localhost:{server.port}",
            "--model-dir", str(folder), "--listen", f"127.0.0.1:{port}",
            "--coordinator-ca", str(folder / "ca.crt"), "--coordinator-cert",
            str(folder / "client.crt"), "--coordinator-key", str(folder / "client.key"),
            "--startup-token-file", str(folder / "token"), "--startup-timeout-s", "20", *extra]


@pytest.fixture
def fronts(tmp_path):
    """Starts fronts (stderr to a file, shown when one fails to start) and kills what is left."""
    started: List[subprocess.Popen] = []

    def start(args: List[str]) -> subprocess.Popen:
        log = open(tmp_path / f"front{len(started)}.err", "w+")
        front = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True)
        started.append(front)
        line = front.stdout.readline()
        if "listening on http://127.0.0.1:" not in line:
            front.kill()
            front.wait(10)
            log.seek(0)
            pytest.fail(f"the front did not start: {line!r} {log.read()}")
        return front

    yield start
    for front in started:
        if front.poll() is None:
            front.kill()
            front.wait(10)


def stop(front: subprocess.Popen, timeout_s: float) -> float:
    """SIGTERM, then the seconds until the process exited 0 (fails past timeout_s)."""
    start = time.monotonic()
    front.send_signal(signal.SIGTERM)
    assert front.wait(timeout_s) == 0
    return time.monotonic() - start


def test_it_dials_over_mutual_tls_with_its_token_and_serves_health(setup, fronts):
    folder, server = setup
    port = free_port()
    front = fronts(front_args(folder, server, port))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        assert r.status == 200
    # The start-up GetLoad and /health's both carry the token from the file.
    assert len(server.coordinator.get_load_metadata) >= 2
    assert all(m.get("authorization") == f"Bearer {TOKEN}"
               for m in server.coordinator.get_load_metadata)
    assert stop(front, 10) < 5


def _without(args: List[str], *flags: str) -> List[str]:
    out: List[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


@pytest.mark.parametrize("change, message", [
    (lambda a: _without(a, "--coordinator-key"), "--coordinator-cert and --coordinator-key go together"),
    (lambda a: _without(a, "--coordinator-ca", "--coordinator-cert", "--coordinator-key"),
     "--startup-token-file needs --coordinator-ca"),
    (lambda a: a + ["--shutdown-grace-s", "-1"], "--shutdown-grace-s and --drain-delay-s must be >= 0"),
    (lambda a: _without(a, "--coordinator-ca", "--startup-token-file"),
     "--coordinator-cert needs --coordinator-ca"),
])
def test_bad_flags_exit_2_naming_the_flag(setup, change, message):
    folder, server = setup
    run = subprocess.run(change(front_args(folder, server, free_port())), capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_a_token_file_of_two_words_is_refused(setup, tmp_path):
    folder, server = setup
    (tmp_path / "token").write_text("two words\n")
    args = front_args(folder, server, free_port())
    args[args.index("--startup-token-file") + 1] = str(tmp_path / "token")
    run = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "holds one token, found 2 words" in run.stderr, run.stderr


def stream_completion(port: int, max_tokens: int, result: dict) -> None:
    """POST a streamed completion and keep what arrived (and whether [DONE] did) in result."""
    body = ('{"model": "word-model", "prompt": "hello world", "stream": true, "max_tokens": %d}'
            % max_tokens).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {TOKEN}"})
    result["chunks"] = 0
    result["done"] = False
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: [DONE]"):
                    result["done"] = True
                elif line.startswith(b"data: "):
                    result["chunks"] += 1
                    result.setdefault("first", time.monotonic())
    except OSError as e:
        result["error"] = repr(e)


def wait_for(predicate, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


# A 20-token stream takes 2 s (a token each 0.1 s); SIGTERM comes after its first chunk. With 30 s
# of grace it ends whole and the process exits as it ends; with 0.5 s (or 0) it is cut and its
# Generate call cancelled, and the process exits that soon.
@pytest.mark.parametrize("grace_s, completes, exit_within_s",
                         [(30, True, 4.0), (0.5, False, 2.0), (0, False, 1.5)])
def test_sigterm_lets_requests_in_flight_run_for_the_grace(setup, fronts, grace_s, completes,
                                                           exit_within_s):
    folder, server = setup
    server.coordinator.step_s = 0.1
    port = free_port()
    front = fronts(front_args(folder, server, port, "--shutdown-grace-s", str(grace_s)))
    cancelled_before = server.coordinator.cancelled
    result: dict = {}
    client = threading.Thread(target=stream_completion, args=(port, 20, result))
    try:
        client.start()
        assert wait_for(lambda: "first" in result), result
        took = stop(front, 30)
        client.join(30)
    finally:
        server.coordinator.step_s = 0.0
    assert took < exit_within_s, took
    assert result["done"] is completes, result
    if completes:
        assert result["chunks"] == 21  # 20 tokens and the finish chunk
    else:
        assert wait_for(lambda: server.coordinator.cancelled == cancelled_before + 1, 10)


def test_during_the_drain_delay_health_is_503_and_requests_are_still_served(setup, fronts):
    folder, server = setup
    port = free_port()
    front = fronts(front_args(folder, server, port, "--drain-delay-s", "2"))
    base = f"http://127.0.0.1:{port}"
    assert status_of(base + "/health") == 200
    start = time.monotonic()
    front.send_signal(signal.SIGTERM)
    assert wait_for(lambda: status_of(base + "/health") == 503, 5)
    assert status_of(base + "/v1/models") == 200
    assert time.monotonic() - start < 2  # still inside the delay
    assert front.wait(10) == 0
    assert time.monotonic() - start >= 2
