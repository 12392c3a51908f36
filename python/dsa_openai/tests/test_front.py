"""The OpenAI front against a scripted coordinator (a grpc.aio server in this process), driven by
the `openai` package as a client would. The model is byte-level (token i < 256 is byte i; 256 ends
a chat turn), so texts and token counts are exact. docs/openai.md."""
from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from typing import List, Optional

import grpc
import openai
import pytest
from aiohttp import web

from dsa_client.proto.dsa.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from dsa_openai import FrontOptions, ModelInfo, OpenAiFront

MODEL = "byte-model"
END_OF_TURN = 256
VOCAB = 258
MAX_CONTEXT = 512


def encode(text: str) -> List[int]:
    return list(text.encode())


def decode(ids) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def render_chat(messages) -> List[int]:
    out: List[int] = []
    for m in messages:
        out += encode(f"<{m['role']}>{m['content']}") + [END_OF_TURN]
    return out + encode("<assistant>")


class ScriptedCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Answers each Generate with `reply` token ids, one per Tokens event, up to max_new_tokens,
    ending at a stop token id as the real coordinator does; or fails with `fail`."""

    def __init__(self):
        self.reply: List[int] = encode("Hello, world!")
        self.fail: Optional[tuple] = None
        self.requests: List[coordinator_pb2.GenerateRequest] = []
        self.metadata: List[dict] = []
        self.cancelled = 0
        self.cancelled_prompts: List[bytes] = []  # the prompts of the calls cancelled
        self.completed = 0

    async def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if self.fail is not None:
            await context.abort(*self.fail)
        yield coordinator_pb2.GenerateEvent(admitted=coordinator_pb2.Admitted())
        reason, stop_id, n = coordinator_pb2.FINISH_REASON_LENGTH, None, 0
        try:
            for token in self.reply:
                if n == request.max_new_tokens:
                    break
                n += 1
                yield coordinator_pb2.GenerateEvent(tokens=coordinator_pb2.Tokens(
                    first_position=len(request.context_tokens.tokens) + n - 1, count=1,
                    token_ids=[token]))
                await asyncio.sleep(0.001)
                if token in request.stop_token_ids:
                    reason, stop_id = coordinator_pb2.FINISH_REASON_STOP_TOKEN, token
                    break
            else:
                if n < request.max_new_tokens:
                    reason = coordinator_pb2.FINISH_REASON_EOS
        except asyncio.CancelledError:
            self.cancelled += 1
            self.cancelled_prompts.append(bytes(t for t in request.context_tokens.tokens if t < 256))
            raise
        finished = coordinator_pb2.Finished(generated_tokens=n, finish_reason=reason)
        if stop_id is not None:
            finished.stop_token_id = stop_id
        self.completed += 1
        yield coordinator_pb2.GenerateEvent(finished=finished)

    async def GetLoad(self, request, context):
        return coordinator_pb2.GetLoadResponse(model=coordinator_pb2.Model(
            name=MODEL, vocab_size=VOCAB, eos_token_id=257, max_context=MAX_CONTEXT))


class Stack:
    """The scripted coordinator and the front, on an event loop of their own thread."""

    def __init__(self):
        self.coordinator = ScriptedCoordinator()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self.ready.set()
        self.loop.run_forever()

    async def _start(self):
        self.grpc_server = grpc.aio.server()
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(self.coordinator,
                                                                      self.grpc_server)
        port = self.grpc_server.add_insecure_port("127.0.0.1:0")
        await self.grpc_server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        model = ModelInfo(name=MODEL, vocab_size=VOCAB, max_context=MAX_CONTEXT, encode=encode,
                          decode=decode, render_chat=render_chat, end_of_turn_id=END_OF_TURN)
        # forward_authorization: the scripted coordinator stands for one behind TLS.
        self.front = OpenAiFront(self.channel, model, FrontOptions(
            timeout_s=30, created=1, forward_authorization=True))
        self.runner = web.AppRunner(self.front.app(), handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.base_url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1"

    def close(self):
        async def stop():
            await self.runner.cleanup()
            await self.channel.close()
            await self.grpc_server.stop(None)
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    s.close()


@pytest.fixture
def client(stack):
    stack.coordinator.reply = encode("Hello, world!")
    stack.coordinator.fail = None
    return openai.OpenAI(base_url=stack.base_url, api_key="token-of-a", max_retries=0)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_a_completion_is_the_generated_text_with_usage(client, stack):
    answer = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=5,
                                       temperature=0.5, top_p=0.9, seed=7)
    assert answer.choices[0].text == "Hello"
    assert answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens,
            answer.usage.total_tokens) == (6, 5, 11)
    sent = stack.coordinator.requests[-1]
    assert list(sent.context_tokens.tokens) == encode("Say hi")
    assert sent.max_new_tokens == 5
    assert sent.sampling.temperature == pytest.approx(0.5)
    assert sent.sampling.top_p == pytest.approx(0.9)
    assert sent.sampling.seed == 7
    assert stack.coordinator.metadata[-1]["authorization"] == "Bearer token-of-a"
    # Token ids are a prompt too; max_tokens defaults to OpenAI's 16.
    answer = client.completions.create(model=MODEL, prompt=[72, 105])
    assert stack.coordinator.requests[-1].max_new_tokens == 16
    assert answer.choices[0].text == "Hello, world!"
    assert answer.choices[0].finish_reason == "stop"  # the model's end of sequence


def test_a_streamed_completion_arrives_in_pieces_that_make_the_text(client):
    pieces, reasons = [], []
    for chunk in client.completions.create(model=MODEL, prompt="Say hi", max_tokens=50,
                                           stream=True):
        pieces.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == "Hello, world!"
    assert len([p for p in pieces if p]) > 1
    assert reasons[-1] == "stop" and all(r is None for r in reasons[:-1])


def test_a_chat_uses_the_template_and_ends_at_the_end_of_turn(client, stack):
    stack.coordinator.reply = encode("Hi there") + [END_OF_TURN] + encode("never sent")
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hello"}])
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == "Hi there"
    assert answer.choices[0].finish_reason == "stop"
    sent = stack.coordinator.requests[-1]
    assert list(sent.context_tokens.tokens) == render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert list(sent.stop_token_ids) == [END_OF_TURN]
    # No max_tokens: up to the model's context.
    assert sent.max_new_tokens == MAX_CONTEXT - len(sent.context_tokens.tokens)
    assert answer.usage.completion_tokens == len(encode("Hi there")) + 1


def test_ignore_eos_runs_to_max_tokens_past_the_end_of_turn(client, stack):
    stack.coordinator.reply = encode("Hi") + [END_OF_TURN] + encode(" more text here")
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
        extra_body={"ignore_eos": True})
    sent = stack.coordinator.requests[-1]
    assert sent.ignore_eos and list(sent.stop_token_ids) == []
    assert answer.choices[0].message.content == "Hi mo"  # 6 tokens, the end of turn one of them
    assert answer.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", extra_body={"ignore_eos": "yes"})
    assert e.value.body["param"] == "ignore_eos"


def test_a_streamed_chat_sends_the_role_then_the_content_then_usage(client, stack):
    stack.coordinator.reply = encode("Hi there") + [END_OF_TURN]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], stream=True,
        stream_options={"include_usage": True}, max_completion_tokens=100))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hi there"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert chunks[-2].choices[0].finish_reason == "stop"


def test_a_stop_string_cuts_the_text_and_cancels_the_call(client, stack):
    stack.coordinator.reply = encode("one, two, three, four, five, six")
    before = stack.coordinator.completed
    answer = client.completions.create(model=MODEL, prompt="count", max_tokens=100,
                                       stop=["three", "zzz"])
    assert answer.choices[0].text == "one, two, "
    assert answer.choices[0].finish_reason == "stop"
    assert stack.coordinator.completed == before  # cancelled, not run to its end
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="count", max_tokens=100, stop="four", stream=True))
    assert streamed == "one, two, three, "


def test_a_long_answer_streams_the_same_text_a_window_at_a_time():
    """IncrementalText decodes a window, not the whole answer: its pieces still join to the text,
    multi-byte characters included, and each decode sees few ids."""
    from dsa_openai import IncrementalText

    text = "h\u00e9llo w\u00f6rld \u4e16\u754c! " * 200
    ids = encode(text)
    widths = []

    def counting_decode(window):
        widths.append(len(window))
        return decode(window)

    incremental = IncrementalText(counting_decode)
    pieces = [incremental.add([i]) for i in ids] + [incremental.finish()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert max(widths) <= 8  # a window of a few ids, never the whole answer (len(ids) > 3000)


def test_a_character_split_across_tokens_is_sent_whole(client, stack):
    stack.coordinator.reply = encode("h\u00e9llo \u4e16\u754c")  # 2- and 3-byte characters
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="x", max_tokens=100, stream=True)]
    assert "".join(pieces) == "h\u00e9llo \u4e16\u754c"
    assert all("\ufffd" not in p for p in pieces)


def test_bad_requests_get_openai_errors_and_reach_no_coordinator(client, stack):
    before = len(stack.coordinator.requests)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    cases = [
        (dict(n=2), "n"), (dict(max_tokens=0), "max_tokens"), (dict(temperature=3), "temperature"),
        (dict(top_p=-1), "top_p"), (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
        (dict(logprobs=2), "logprobs"), (dict(echo=True), "echo"),
        (dict(extra_body={"stream_options": {"include_usage": True}}), "stream_options"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", **extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
        assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[1, 2, VOCAB])
    assert "outside the vocabulary" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x" * 500, max_tokens=100)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}])
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    assert len(stack.coordinator.requests) == before


def test_coordinator_errors_become_http_statuses(client, stack):
    for code, error in [(grpc.StatusCode.RESOURCE_EXHAUSTED, openai.RateLimitError),
                        (grpc.StatusCode.INVALID_ARGUMENT, openai.BadRequestError),
                        (grpc.StatusCode.UNAUTHENTICATED, openai.AuthenticationError),
                        (grpc.StatusCode.UNAVAILABLE, openai.InternalServerError)]:
        stack.coordinator.fail = (code, f"scripted {code.name}")
        with pytest.raises(error) as e:
            client.completions.create(model=MODEL, prompt="x")
        assert e.value.body["message"] == f"scripted {code.name}"
        # Streamed: the status comes before any event, so it is still the HTTP status.
        with pytest.raises(error):
            list(client.completions.create(model=MODEL, prompt="x", stream=True))


def test_a_body_that_is_not_json_is_a_400(stack):
    request = urllib.request.Request(f"{stack.base_url}/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 400
    assert json.loads(e.value.read())["error"]["type"] == "invalid_request_error"


def test_health_says_whether_the_coordinator_serves_the_model(stack):
    with urllib.request.urlopen(stack.base_url.removesuffix("/v1") + "/health", timeout=10) as r:
        assert r.status == 200 and json.loads(r.read())["model"] == MODEL
