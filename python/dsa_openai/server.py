"""dsa-openai: an OpenAI-compatible HTTP front of dsa-coordinator (docs/openai.md).

    POST /v1/completions        prompt (text or token ids) -> text; SSE with "stream": true
    POST /v1/chat/completions   messages -> the model's chat template -> text; SSE likewise
    GET  /v1/models             the model the coordinator serves (its GetLoad's model)
    GET  /health                200 when the coordinator answers GetLoad with a model, else 503 (and once draining)

Each request is one Generate call on the coordinator's gRPC API (grpc.aio): the prompt's token ids
in, token ids out, turned into text as they stream (`IncrementalText`), cut at the first stop
string (`StopMatcher`, which then cancels the call). A client's "Authorization: Bearer T" header
is sent on as the call's "authorization" metadata when the front dials the coordinator over TLS:
the coordinator's --auth-tokens-file checks it, and its tenant scopes the request (fair queuing,
sessions, request ids). A streamed request whose client went away is cancelled at its next
write; aiohttp's handler cancellation cancels others when it notices the connection lost. gRPC errors become OpenAI's error JSON: INVALID_ARGUMENT 400, UNAUTHENTICATED
401, PERMISSION_DENIED 403, NOT_FOUND 404, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503,
DEADLINE_EXCEEDED 504, others 500."""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import grpc
from aiohttp import web

from dsa_client.proto.dsa.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc

from .protocol import (ApiError, IncrementalText, Plan, StopMatcher, chat_plan, completion_plan)

log = logging.getLogger("dsa_openai")

#: The HTTP status of each gRPC code the coordinator answers.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}

#: OpenAI's finish_reason of each of the coordinator's FinishReasons.
FINISH_REASON = {
    coordinator_pb2.FINISH_REASON_LENGTH: "length",
    coordinator_pb2.FINISH_REASON_EOS: "stop",
    coordinator_pb2.FINISH_REASON_STOP_TOKEN: "stop",
}


def api_error_of(error: grpc.aio.AioRpcError) -> ApiError:
    """The OpenAI error of a failed gRPC call (HTTP_STATUS; 500 for other codes)."""
    status, kind = HTTP_STATUS.get(error.code(), (500, "server_error"))
    return ApiError(status, error.details() or error.code().name, kind,
                    code=error.code().name.lower())


@dataclass
class ModelInfo:
    """What the front needs of the served model. encode: text -> ids; decode: ids -> text
    (special tokens skipped); render_chat: messages -> prompt ids; end_of_turn_id: the chat
    answer's last token; max_context: context + max_tokens at most (0: no limit)."""
    name: str
    vocab_size: int
    max_context: int
    encode: Callable[[str], List[int]]
    decode: Callable[[Sequence[int]], str]
    render_chat: Callable[[List[Dict[str, str]]], List[int]]
    end_of_turn_id: int


@dataclass
class FrontOptions:
    """timeout_s: each Generate call's deadline. created: /v1/models' `created` (Unix seconds).
    forward_authorization: send a client's Authorization header on to the coordinator (only over
    TLS: the coordinator checks tokens on a TLS port alone, and a token must not cross
    plaintext). health_token: the bearer token /health's GetLoad sends when its caller sent none
    (probes send none), for a coordinator with --auth-tokens-file."""
    timeout_s: float = 600.0
    created: int = 0
    forward_authorization: bool = False
    health_token: Optional[str] = None


def _json(data: Dict[str, Any], status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


def _error_response(error: ApiError) -> web.Response:
    return _json(error.body(), error.status)


class OpenAiFront:
    """The HTTP handlers over one coordinator channel. `model`: the served model's tokenizer and
    template (the coordinator's GetLoad must name the same model: checked by `check_model`)."""

    def __init__(self, channel: grpc.aio.Channel, model: ModelInfo, options: FrontOptions):
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        self._model = model
        self._options = options
        self._draining = False  # /health answers 503: load balancers take the front out
        self._closing = False  # new requests are refused 503; those in flight run on
        self._in_flight: set = set()  # the tasks of the requests being served

    @web.middleware
    async def _track(self, request: web.Request, handler) -> web.StreamResponse:
        if self._closing:
            return _error_response(ApiError(503, "the front is shutting down: retry on another",
                                            "server_error"))
        task = asyncio.current_task()
        self._in_flight.add(task)
        try:
            return await handler(request)
        finally:
            self._in_flight.discard(task)

    def start_drain(self) -> None:
        """From now /health answers 503 ("draining"); requests are still served."""
        self._draining = True

    async def close(self, grace_s: float) -> int:
        """Refuses new requests (503) and gives those in flight grace_s seconds to end, then
        cancels the rest (and so their Generate calls). Returns how many were cancelled."""
        self._draining = self._closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._in_flight and loop.time() < deadline:
            await asyncio.wait(set(self._in_flight), timeout=deadline - loop.time())
        left = set(self._in_flight)
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=5)
        return len(left)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 << 20, middlewares=[self._track])
        app.add_routes([
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}", self.model),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/health", self.health),
        ])
        return app

    def _metadata(self, request: web.Request) -> Optional[Sequence[tuple]]:
        header = request.headers.get("Authorization")
        if not header or not self._options.forward_authorization:
            return None
        return (("authorization", header),)

    async def check_model(self, metadata=None) -> None:
        """Raises ApiError 503 unless the coordinator answers GetLoad and serves this model."""
        try:
            load = await self._stub.GetLoad(coordinator_pb2.GetLoadRequest(), timeout=5,
                                            metadata=metadata)
        except grpc.aio.AioRpcError as e:
            raise api_error_of(e) from None
        if load.model.name != self._model.name:
            raise ApiError(503, f"the coordinator serves {load.model.name or 'no model yet'!r}, "
                           f"this front {self._model.name!r}", "server_error")

    async def health(self, request: web.Request) -> web.Response:
        if self._draining:
            return _error_response(ApiError(503, "the front is draining", "server_error"))
        metadata = self._metadata(request)
        if metadata is None and self._options.health_token:
            metadata = (("authorization", f"Bearer {self._options.health_token}"),)
        try:
            await self.check_model(metadata)
        except ApiError as e:
            return _error_response(e if e.status >= 500 else ApiError(503, e.message, e.kind))
        return _json({"status": "ok", "model": self._model.name})

    def _model_card(self) -> Dict[str, Any]:
        return {"id": self._model.name, "object": "model", "created": self._options.created,
                "owned_by": "dsa-indexer", "max_model_len": self._model.max_context or None}

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self._model.name:
            return _error_response(ApiError(404, f"The model '{request.match_info['model']}' "
                                            "does not exist", "not_found_error", "model",
                                            "model_not_found"))
        return _json(self._model_card())

    async def _body(self, request: web.Request) -> Dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._plan_and_serve(request, "cmpl", lambda body: completion_plan(
            body, self._model.name, self._model.encode, self._model.vocab_size))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._plan_and_serve(request, "chatcmpl", lambda body: chat_plan(
            body, self._model.name, self._model.render_chat, self._model.end_of_turn_id))

    async def _plan_and_serve(self, request: web.Request, id_prefix: str,
                              plan_of: Callable[[Dict[str, Any]], Plan]) -> web.StreamResponse:
        """The request's body through `plan_of` (its ApiError answered as such), then served
        under the id "<id_prefix>-<uuid>"."""
        try:
            plan = plan_of(await self._body(request))
        except ApiError as e:
            return _error_response(e)
        return await self._serve(request, plan, f"{id_prefix}-{uuid.uuid4().hex}")

    def _generate_request(self, plan: Plan, request_id: str) -> coordinator_pb2.GenerateRequest:
        max_tokens = plan.max_tokens
        prompt = len(plan.prompt_ids)
        if self._model.max_context:
            room = self._model.max_context - prompt
            if room < 1:
                raise ApiError(400, f"the prompt is {prompt} tokens; this model's context is "
                               f"{self._model.max_context}", param="messages"
                               if plan.kind == "chat" else "prompt",
                               code="context_length_exceeded")
            if max_tokens is None:
                max_tokens = room
            elif prompt + max_tokens > self._model.max_context:
                raise ApiError(400, f"the prompt ({prompt} tokens) plus max_tokens ({max_tokens})"
                               f" is over this model's context of {self._model.max_context}",
                               param="max_tokens", code="context_length_exceeded")
        elif max_tokens is None:
            raise ApiError(400, "max_tokens is required: the model states no context length",
                           param="max_tokens")
        sampling = coordinator_pb2.SamplingParams(temperature=plan.sampling.temperature,
                                                  top_p=plan.sampling.top_p)
        if plan.sampling.seed is not None:
            sampling.seed = plan.sampling.seed
        return coordinator_pb2.GenerateRequest(
            request_id=request_id, context_tokens=coordinator_pb2.ContextTokens(
                tokens=plan.prompt_ids), max_new_tokens=max_tokens, sampling=sampling,
            stop_token_ids=plan.stop_token_ids, ignore_eos=plan.ignore_eos)

    async def _serve(self, request: web.Request, plan: Plan,
                     request_id: str) -> web.StreamResponse:
        try:
            generate = self._generate_request(plan, request_id)
        except ApiError as e:
            return _error_response(e)
        created = int(time.time())
        call = self._stub.Generate(generate, timeout=self._options.timeout_s,
                                   metadata=self._metadata(request))
        text = IncrementalText(self._model.decode)
        stop = StopMatcher(plan.stop)
        completion_tokens = 0
        finish_reason = None
        pieces: List[str] = []
        response: Optional[web.StreamResponse] = None
        chunk = _Chunks(plan, request_id, created)

        async def send(piece: str) -> None:
            nonlocal response
            if not piece:
                return
            if not plan.stream:
                pieces.append(piece)
                return
            if response is None:
                response = await self._start_stream(request, chunk)
            await _sse(response, chunk.delta(piece))

        try:
            async for event in call:
                which = event.WhichOneof("event")
                if which == "admitted" and plan.stream and response is None:
                    # Headers go out once the request is admitted: queue and validation errors
                    # still get their HTTP status.
                    response = await self._start_stream(request, chunk)
                elif which == "tokens":
                    completion_tokens += len(event.tokens.token_ids)
                    await send(stop.feed(text.add(event.tokens.token_ids)))
                    if stop.stopped:
                        finish_reason = "stop"
                        call.cancel()
                        break
                elif which == "finished":
                    finish_reason = FINISH_REASON.get(event.finished.finish_reason, "stop")
        except grpc.aio.AioRpcError as e:
            if not stop.stopped:
                error = api_error_of(e)
                if response is None:
                    return _error_response(error)
                await _sse(response, error.body())  # the stream has begun: the error as an event
                await _sse_done(response)
                return response
        except (ConnectionResetError, asyncio.CancelledError):
            call.cancel()  # the client went away: so does its request
            raise
        if not stop.stopped:
            await send(stop.feed(text.finish()))
            await send(stop.finish())
            if stop.stopped:  # the stop string was in the last piece
                finish_reason = "stop"
        usage = {"prompt_tokens": len(plan.prompt_ids), "completion_tokens": completion_tokens,
                 "total_tokens": len(plan.prompt_ids) + completion_tokens}
        if not plan.stream:
            return _json(chunk.whole("".join(pieces), finish_reason, usage))
        if response is None:
            response = await self._start_stream(request, chunk)
        await _sse(response, chunk.final(finish_reason))
        if plan.include_usage:
            await _sse(response, chunk.usage(usage))
        await _sse_done(response)
        return response

    @staticmethod
    async def _start_stream(request: web.Request, chunk: "_Chunks") -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        first = chunk.first()
        if first is not None:
            await _sse(response, first)
        return response


async def _sse(response: web.StreamResponse, data: Dict[str, Any]) -> None:
    await response.write(f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode())


async def _sse_done(response: web.StreamResponse) -> None:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()


class _Chunks:
    """The JSON objects of one answer, in OpenAI's shapes: `whole` (not streamed), or `first`
    (chat: the role), `delta` per text piece, `final` (finish_reason) and `usage` chunks."""

    def __init__(self, plan: Plan, request_id: str, created: int):
        self._plan = plan
        self._id = request_id
        self._created = created
        chat = plan.kind == "chat"
        self._object = "chat.completion" if chat else "text_completion"
        self._chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def _base(self, streamed: bool) -> Dict[str, Any]:
        return {"id": self._id, "object": self._chunk_object if streamed else self._object,
                "created": self._created, "model": self._plan.model}

    def _choice(self, text: Optional[str], finish_reason: Optional[str],
                role: bool = False) -> Dict[str, Any]:
        if self._plan.kind == "chat":
            delta: Dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

    def first(self) -> Optional[Dict[str, Any]]:
        if self._plan.kind != "chat":
            return None
        return {**self._base(True), "choices": [self._choice("", None, role=True)]}

    def delta(self, text: str) -> Dict[str, Any]:
        return {**self._base(True), "choices": [self._choice(text, None)]}

    def final(self, finish_reason: Optional[str]) -> Dict[str, Any]:
        out = {**self._base(True), "choices": [self._choice(None, finish_reason)]}
        if self._plan.include_usage:
            out["usage"] = None
        return out

    def usage(self, usage: Dict[str, int]) -> Dict[str, Any]:
        return {**self._base(True), "choices": [], "usage": usage}

    def whole(self, text: str, finish_reason: Optional[str],
              usage: Dict[str, int]) -> Dict[str, Any]:
        if self._plan.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._base(False), "choices": [choice], "usage": usage}


def server_ssl_context(cert_file: Optional[str], key_file: Optional[str]) -> Optional[ssl.SSLContext]:
    """TLS for the HTTP port from PEM files; None without them. ValueError for one without the
    other."""
    if cert_file is None and key_file is None:
        return None
    if cert_file is None or key_file is None:
        raise ValueError("--tls-cert and --tls-key go together")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context
