"""A small client of dsa-coordinator for routers: Generate (streamed events), Abort, GetLoad, and
the grpc.health.v1 check of the three health names (docs/deploy.md, "The contract").

    from dsa_client import CoordinatorClient

    with CoordinatorClient.connect("127.0.0.1:50051") as client:
        print(client.health("readiness"))              # "SERVING"
        for event in client.generate("req-1", context_length=4096, max_new_tokens=16):
            print(event.WhichOneof("event"))           # admitted, tokens..., finished
        print(client.get_load().queued)

        # A real model (GetLoad's model.vocab_size > 0): token ids in, token ids out.
        generation = client.generate("req-2", context_tokens=[504, 3575, 282, 4649, 314],
                                     max_new_tokens=12, sampling=Sampling(temperature=0.7))
        for token_id in generation.token_ids():        # as they stream
            print(token_id)
        print(generation.finished.finish_reason)       # FINISH_REASON_LENGTH, _EOS, _STOP_TOKEN

    # TLS (mutual with cert_file/key_file) and a bearer token (docs/deploy.md, "TLS, mutual TLS
    # and bearer tokens"):
    credentials = tls_credentials(ca_file="ca.crt", cert_file="client.crt", key_file="client.key")
    client = CoordinatorClient.connect("dsa.example:443", credentials=credentials, token=TOKEN)

Errors are grpc.RpcError with the status codes the proto documents (coordinator.proto):
RESOURCE_EXHAUSTED (queue full), INVALID_ARGUMENT, ALREADY_EXISTS, FAILED_PRECONDITION,
UNAVAILABLE (also a TLS handshake that fails: plaintext, an untrusted CA, a missing client
certificate), CANCELLED (the request was aborted), NOT_FOUND (abort of an id this caller has not
in flight: request ids are scoped per caller, so another caller's request is not found either),
UNAUTHENTICATED (a missing or unknown bearer token).
Thread-safety: one client may be used from many threads (a gRPC channel is thread-safe).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsa_client.proto.dsa.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc

__all__ = ["CoordinatorClient", "AsyncCoordinatorClient", "Overrides", "Sampling", "Generation",
           "AsyncGeneration", "HEALTH_SERVICE_NAMES", "DEFAULT_GENERATE_TIMEOUT_S",
           "tls_credentials"]

#: The health names every dsa server answers (docs/deploy.md, "Health").
HEALTH_SERVICE_NAMES = ("liveness", "readiness", "")


def _read_pem(path: str, what: str) -> bytes:
    with open(path, "rb") as f:
        pem = f.read()
    if b"-----BEGIN " not in pem:
        raise ValueError(f"{what} {path} holds no PEM block")
    return pem


def tls_credentials(ca_file: Optional[str] = None, cert_file: Optional[str] = None,
                    key_file: Optional[str] = None) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files: ca_file, the CA bundle the server's certificate must
    chain to (None = the system's roots), and for mutual TLS cert_file (this client's certificate
    chain) with key_file (its private key), e.g. a kubernetes.io/tls Secret's ca.crt, tls.crt and
    tls.key. The files are read once, here. Raises ValueError for cert_file without key_file (or
    the reverse) or a file without a PEM block, OSError for a file that cannot be read."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("cert_file and key_file go together (mutual TLS needs both)")
    return grpc.ssl_channel_credentials(
        root_certificates=None if ca_file is None else _read_pem(ca_file, "ca_file"),
        private_key=None if key_file is None else _read_pem(key_file, "key_file"),
        certificate_chain=None if cert_file is None else _read_pem(cert_file, "cert_file"))


#: grpc.health.v1 messages (grpcio-health-checking's): HealthCheckRequest(service=...),
#: HealthCheckResponse(status=...).
HealthCheckRequest, HealthCheckResponse = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"

#: The deadline of a Generate stream when the caller gives none (seconds): a long generation on
#: a CPU cluster takes minutes; pass timeout_s=None for no deadline.
DEFAULT_GENERATE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Overrides:
    """Per-request overrides of the deployment's defaults (coordinator.proto's Overrides); None
    keeps the default.

    target_block_sparsity: SPIN's rho, in [0, 1). exploration_fraction: gamma, in [0, 1).
    top_k: selection size K, >= 1. all_keep: select every block. acceptance_rate: of the seeded
    draft acceptance model, in [0, 1].
    """

    target_block_sparsity: Optional[float] = None
    exploration_fraction: Optional[float] = None
    top_k: Optional[int] = None
    all_keep: Optional[bool] = None
    acceptance_rate: Optional[float] = None

    def to_proto(self) -> coordinator_pb2.Overrides:
        fields = {name: value for name, value in vars(self).items() if value is not None}
        return coordinator_pb2.Overrides(**fields)


@dataclass(frozen=True)
class Sampling:
    """How a real model draws a request's tokens (coordinator.proto's SamplingParams).

    temperature: 0 = greedy (the most probable token), else in (0, 100]. top_p: nucleus, in
    (0, 1]; 0 means 1 (no cut). seed: the draw at each position is a pure function of (seed,
    position), so a request repeats exactly; None lets the coordinator pick one per request. The
    pattern model validates and ignores it.
    """

    temperature: float = 0.0
    top_p: float = 0.0
    seed: Optional[int] = None

    def to_proto(self) -> coordinator_pb2.SamplingParams:
        proto = coordinator_pb2.SamplingParams(temperature=self.temperature, top_p=self.top_p)
        if self.seed is not None:
            proto.seed = self.seed
        return proto


def _channel_settings(credentials, root_certificates, private_key, certificate_chain, token,
                      server_name, options):
    """The credentials and channel arguments of connect() (CoordinatorClient's and
    AsyncCoordinatorClient's): its rules and errors."""
    if credentials is None and (root_certificates or private_key or certificate_chain):
        credentials = grpc.ssl_channel_credentials(
            root_certificates=root_certificates, private_key=private_key,
            certificate_chain=certificate_chain)
    options = list(options)
    if token is not None:
        if credentials is None:
            raise ValueError("a bearer token needs TLS credentials (credentials= or "
                             "root_certificates=): tokens must not cross plaintext")
        if not token or any(c.isspace() for c in token):
            raise ValueError("a bearer token is one word: not empty, no white space")
        credentials = grpc.composite_channel_credentials(
            credentials, grpc.access_token_call_credentials(token))
    if server_name is not None:
        if credentials is None:
            raise ValueError("server_name needs TLS credentials (it names the certificate "
                             "to expect)")
        options.append(("grpc.ssl_target_name_override", server_name))
    return credentials, options


def _generate_request(request_id, max_new_tokens, context_length, context_tokens,
                      prefix_block_ids, draft_length, session_id, overrides, sampling,
                      stop_token_ids, ignore_eos) -> coordinator_pb2.GenerateRequest:
    if (context_length is None) == (context_tokens is None):
        raise ValueError("give exactly one of context_length and context_tokens")
    request = coordinator_pb2.GenerateRequest(
        request_id=request_id, max_new_tokens=max_new_tokens,
        prefix_block_ids=list(prefix_block_ids), draft_length=draft_length,
        session_id=session_id, stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    if context_length is not None:
        request.context_length = context_length
    else:
        request.context_tokens.tokens.extend(context_tokens)
    if overrides is not None:
        request.overrides.CopyFrom(overrides.to_proto())
    if sampling is not None:
        request.sampling.CopyFrom(sampling.to_proto())
    return request


def _token_ids_of(generation, event) -> Sequence[int]:
    """A Tokens event's generated ids; an Admitted or Finished event is kept on `generation`
    (.admitted, .finished) and has none."""
    kind = event.WhichOneof("event")
    if kind == "admitted":
        generation.admitted = event.admitted
    elif kind == "finished":
        generation.finished = event.finished
    return event.tokens.token_ids if kind == "tokens" else ()


class Generation:
    """One Generate call in flight: iterate it for its GenerateEvents (admitted once, then one
    tokens per decode step, then finished), or token_ids() for a real model's generated ids; the
    iteration raises grpc.RpcError if the stream ends with an error (CANCELLED after an abort).
    cancel() drops the stream from this side only (the coordinator sees the client go away);
    abort the request by id to stop it for every caller."""

    def __init__(self, request_id: str, call):
        self.request_id = request_id
        self._call = call
        self.admitted: Optional[coordinator_pb2.Admitted] = None
        self.finished: Optional[coordinator_pb2.Finished] = None

    def __iter__(self) -> Iterator[coordinator_pb2.GenerateEvent]:
        return iter(self._call)

    def token_ids(self) -> Iterator[int]:
        """Iterates the stream and yields each generated token id as its Tokens event arrives (a
        real model: Tokens.token_ids; the pattern model yields none), keeping the Admitted and
        Finished events in .admitted and .finished (Finished.finish_reason says why it ended:
        LENGTH, EOS or STOP_TOKEN, with stop_token_id). Raises grpc.RpcError as iterating does.
        Consumes the stream: iterate the Generation or call this, not both. Leaving the loop
        early (break, an exception) cancels the call once the iterator is closed, so the
        coordinator frees the request's slot."""
        ended = False
        try:
            for event in self._call:
                yield from _token_ids_of(self, event)
            ended = True
        finally:
            if not ended:
                self._call.cancel()

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        """Leaving a with block cancels the call unless the stream has ended."""
        self._call.cancel()

    def cancel(self) -> None:
        """Cancels the call on the client side (the iteration then raises CANCELLED)."""
        self._call.cancel()

    def code(self) -> grpc.StatusCode:
        """The stream's final status code (blocks until the stream has ended)."""
        return self._call.code()


class CoordinatorClient:
    """A client of one dsa-coordinator (CoordinatorService and grpc.health.v1) over one channel.
    Build it with connect(); close() (or a with block) closes the channel."""

    def __init__(self, channel: grpc.Channel):
        """Wraps an existing channel (the caller's options, interceptors or credentials)."""
        self._channel = channel
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        self._health_check = channel.unary_unary(
            HEALTH_CHECK_METHOD,
            request_serializer=HealthCheckRequest.SerializeToString,
            response_deserializer=HealthCheckResponse.FromString)

    @classmethod
    def connect(cls, target: str, *, credentials: Optional[grpc.ChannelCredentials] = None,
                root_certificates: Optional[bytes] = None, private_key: Optional[bytes] = None,
                certificate_chain: Optional[bytes] = None, token: Optional[str] = None,
                server_name: Optional[str] = None,
                options: Sequence[tuple[str, object]] = ()) -> "CoordinatorClient":
        """Opens a channel to target ("host:port"). Plaintext unless TLS is asked for: either
        credentials (any grpc.ChannelCredentials, e.g. tls_credentials(...)), or PEM bytes:
        root_certificates (the CA to trust; None = the system's), with private_key and
        certificate_chain for mutual TLS.
        token: a bearer token sent on every call as "authorization: Bearer <token>" (the
        coordinator's --auth-tokens-file); needs TLS credentials: ValueError without them (a token
        must not cross the network in plaintext), or for an empty token or one with white space.
        server_name: the name checked in the server's certificate instead of target's host (e.g.
        the Service's name when target is a port-forward's 127.0.0.1); needs TLS credentials.
        options: gRPC channel arguments, e.g. [("grpc.max_receive_message_length", 8 << 20)]."""
        credentials, options = _channel_settings(credentials, root_certificates, private_key,
                                                 certificate_chain, token, server_name, options)
        if credentials is not None:
            channel = grpc.secure_channel(target, credentials, options=options)
        else:
            channel = grpc.insecure_channel(target, options=options)
        return cls(channel)

    def close(self) -> None:
        """Closes the channel; calls in flight end with CANCELLED."""
        self._channel.close()

    def __enter__(self) -> "CoordinatorClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(self, request_id: str, *, max_new_tokens: int,
                 context_length: Optional[int] = None,
                 context_tokens: Optional[Iterable[int]] = None,
                 prefix_block_ids: Iterable[int] = (), draft_length: int = 0,
                 session_id: str = "", overrides: Optional[Overrides] = None,
                 sampling: Optional[Sampling] = None, stop_token_ids: Iterable[int] = (),
                 ignore_eos: bool = False,
                 timeout_s: Optional[float] = DEFAULT_GENERATE_TIMEOUT_S,
                 wait_for_ready: Optional[bool] = None) -> Generation:
        """Starts a Generate and returns it; iterate the result for its events, or its
        token_ids() for a real model's generated ids.

        request_id: caller-chosen, 1..128 bytes, unique among requests in flight.
        context_length (synthetic tokens, >= 1: the pattern model only) or context_tokens (token
        ids: a real model's prompt, each in [0, vocab_size) of GetLoad's model): exactly one.
        max_new_tokens: >= 1. prefix_block_ids: shared-prefix block ids, one per 512 tokens
        (context_length only: with context_tokens the coordinator derives them from the tokens).
        draft_length: speculative draft length in 0..4 (a real model's are n-gram drafts kept
        where its own tokens confirm them). session_id: continue a multi-turn sequence (empty = a
        one-off request). sampling: a real model's draws (None = greedy). stop_token_ids: a real
        model ends after any of these ids (at most 256). ignore_eos: a real model goes on past its
        end-of-sequence token. timeout_s: deadline of the whole stream (default
        DEFAULT_GENERATE_TIMEOUT_S; None = none).
        wait_for_ready: gRPC's wait-for-ready (queue the call while the channel connects).
        Raises ValueError when both or neither context form is given; the coordinator answers
        INVALID_ARGUMENT for an id out of range (the stream raises grpc.RpcError).
        """
        request = _generate_request(request_id, max_new_tokens, context_length, context_tokens,
                                    prefix_block_ids, draft_length, session_id, overrides,
                                    sampling, stop_token_ids, ignore_eos)
        call = self._stub.Generate(request, timeout=timeout_s, wait_for_ready=wait_for_ready)
        return Generation(request_id, call)

    def abort(self, request_id: str, *, timeout_s: float = 5.0) -> None:
        """Stops a request in flight (queued or running); its Generate stream ends with
        CANCELLED. Raises grpc.RpcError NOT_FOUND if this caller (bearer token's client, or
        client certificate) has no request of that id in flight; ids are scoped per caller, so
        another caller's request of that id is not found either."""
        self._stub.Abort(coordinator_pb2.AbortRequest(request_id=request_id), timeout=timeout_s)

    def get_load(self, *, timeout_s: float = 5.0) -> coordinator_pb2.GetLoadResponse:
        """Queue, running requests and index-key cache use (blocks used / capacity, over all
        indexer workers and per worker): what a router balances on."""
        return self._stub.GetLoad(coordinator_pb2.GetLoadRequest(), timeout=timeout_s)

    def health(self, service: str = "readiness", *, timeout_s: float = 2.0) -> str:
        """The grpc.health.v1 status of one name ("liveness", "readiness" or "" = readiness) as
        its enum name: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN". Raises
        grpc.RpcError when the server cannot be reached (UNAVAILABLE, DEADLINE_EXCEEDED) or does
        not know the name (NOT_FOUND)."""
        response = self._health_check(HealthCheckRequest(service=service), timeout=timeout_s)
        return HealthCheckResponse.ServingStatus.Name(response.status)


class AsyncGeneration:
    """One Generate call in flight on an AsyncCoordinatorClient: `async for` it for its
    GenerateEvents, or `async for` its token_ids(); both raise grpc.aio.AioRpcError when the
    stream ends with an error. cancel() drops the stream from this side."""

    def __init__(self, request_id: str, call):
        self.request_id = request_id
        self._call = call
        self.admitted: Optional[coordinator_pb2.Admitted] = None
        self.finished: Optional[coordinator_pb2.Finished] = None

    def __aiter__(self) -> AsyncIterator[coordinator_pb2.GenerateEvent]:
        return self._call.__aiter__()

    async def token_ids(self) -> AsyncIterator[int]:
        """As Generation.token_ids: each generated id as its Tokens event arrives, keeping
        .admitted and .finished. Consumes the stream. Leaving the loop early cancels the call when
        the generator is closed (at once with `async with`, else when asyncio finalizes it)."""
        ended = False
        try:
            async for event in self._call:
                for token in _token_ids_of(self, event):
                    yield token
            ended = True
        finally:
            if not ended:
                self._call.cancel()

    async def __aenter__(self) -> "AsyncGeneration":
        return self

    async def __aexit__(self, *exc) -> None:
        """Leaving an async with block cancels the call unless the stream has ended."""
        self._call.cancel()

    def cancel(self) -> None:
        """Cancels the call on the client side."""
        self._call.cancel()

    async def code(self) -> grpc.StatusCode:
        """The stream's final status code (waits until the stream has ended)."""
        return await self._call.code()


class AsyncCoordinatorClient:
    """CoordinatorClient for asyncio (grpc.aio): the same methods, each a coroutine (generate
    returns an AsyncGeneration at once), the same arguments, defaults and errors. Build it with
    connect() inside a running event loop; `await close()` (or `async with`) closes the channel."""

    def __init__(self, channel: grpc.aio.Channel):
        self._channel = channel
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)

    @classmethod
    def connect(cls, target: str, *, credentials: Optional[grpc.ChannelCredentials] = None,
                root_certificates: Optional[bytes] = None, private_key: Optional[bytes] = None,
                certificate_chain: Optional[bytes] = None, token: Optional[str] = None,
                server_name: Optional[str] = None,
                options: Sequence[tuple[str, object]] = ()) -> "AsyncCoordinatorClient":
        """As CoordinatorClient.connect (the same rules: a token needs TLS, ...)."""
        credentials, options = _channel_settings(credentials, root_certificates, private_key,
                                                 certificate_chain, token, server_name, options)
        if credentials is not None:
            return cls(grpc.aio.secure_channel(target, credentials, options=options))
        return cls(grpc.aio.insecure_channel(target, options=options))

    async def close(self) -> None:
        """Closes the channel; calls in flight end with CANCELLED."""
        await self._channel.close()

    async def __aenter__(self) -> "AsyncCoordinatorClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def generate(self, request_id: str, *, max_new_tokens: int,
                 context_length: Optional[int] = None,
                 context_tokens: Optional[Iterable[int]] = None,
                 prefix_block_ids: Iterable[int] = (), draft_length: int = 0,
                 session_id: str = "", overrides: Optional[Overrides] = None,
                 sampling: Optional[Sampling] = None, stop_token_ids: Iterable[int] = (),
                 ignore_eos: bool = False,
                 timeout_s: Optional[float] = DEFAULT_GENERATE_TIMEOUT_S,
                 wait_for_ready: Optional[bool] = None) -> AsyncGeneration:
        """As CoordinatorClient.generate; `async for` the result."""
        request = _generate_request(request_id, max_new_tokens, context_length, context_tokens,
                                    prefix_block_ids, draft_length, session_id, overrides,
                                    sampling, stop_token_ids, ignore_eos)
        call = self._stub.Generate(request, timeout=timeout_s, wait_for_ready=wait_for_ready)
        return AsyncGeneration(request_id, call)

    async def abort(self, request_id: str, *, timeout_s: float = 5.0) -> None:
        """As CoordinatorClient.abort."""
        await self._stub.Abort(coordinator_pb2.AbortRequest(request_id=request_id),
                               timeout=timeout_s)

    async def get_load(self, *, timeout_s: float = 5.0) -> coordinator_pb2.GetLoadResponse:
        """As CoordinatorClient.get_load."""
        return await self._stub.GetLoad(coordinator_pb2.GetLoadRequest(), timeout=timeout_s)

    async def health(self, service: str = "readiness", *, timeout_s: float = 2.0) -> str:
        """As CoordinatorClient.health."""
        response = await self._health.Check(HealthCheckRequest(service=service), timeout=timeout_s)
        return HealthCheckResponse.ServingStatus.Name(response.status)
