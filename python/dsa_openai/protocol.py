"""OpenAI's completions and chat completions requests, checked and turned into what the coordinator
takes (docs/openai.md). Pure: no I/O, no gRPC.

A request is refused with `ApiError` (HTTP status, OpenAI's error `type`, the offending `param`,
a message naming the value) before anything is sent: OpenAI's JSON error shape is
{"error": {"message", "type", "param", "code"}}. Fields the front cannot honour (n > 1, logprobs,
echo, best_of, suffix, tools) are refused by name rather than ignored."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

#: OpenAI's default max_tokens for /v1/completions (chat: up to the model's context).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: OpenAI allows at most 4 stop sequences.
MAX_STOP_SEQUENCES = 4
#: The coordinator's request ids are 1..128 bytes (coordinator.proto).
MAX_USER_BYTES = 256

#: OpenAI's temperature range; the coordinator's 0 means greedy.
MAX_TEMPERATURE = 2.0


class ApiError(Exception):
    """An error answered in OpenAI's shape. status: the HTTP status; kind: the error `type`
    ("invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error",
    "server_error"); param: the request field at fault, or None; code: a short code or None."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code

    def body(self) -> Dict[str, Any]:
        """The JSON body: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


@dataclass
class Sampling:
    """How tokens are drawn: temperature 0 is greedy (the coordinator's SamplingParams)."""
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None


@dataclass
class Plan:
    """What one request asks of the coordinator, and how to answer it.

    prompt_ids: the prompt's token ids (chat: the chat template applied). max_tokens: tokens to
    generate at most (None: up to the model's context). stop: stop strings (the text ends before
    the first). stop_token_ids: token ids that end the request (chat: the end-of-turn token).
    ignore_eos: generate max_tokens tokens whatever the model's end of sequence (vLLM's field).
    stream / include_usage: SSE chunks, and a last chunk with usage."""
    kind: str  # "completion" or "chat"
    model: str
    prompt_ids: List[int]
    max_tokens: Optional[int]
    sampling: Sampling
    stop: List[str] = field(default_factory=list)
    stop_token_ids: List[int] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    user: Optional[str] = None
    ignore_eos: bool = False


def _number(body: Dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(name, f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise invalid(name, f"{name} must be in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _integer(body: Dict[str, Any], name: str, low: int, high: Optional[int] = None) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise invalid(name, f"{name} must be {bound}, got {value}")
    return value


def _refuse_unsupported(body: Dict[str, Any]) -> None:
    if body.get("n") not in (None, 1):
        raise invalid("n", f"only n = 1 is served, got {body.get('n')!r}")
    if body.get("best_of") not in (None, 1):
        raise invalid("best_of", f"only best_of = 1 is served, got {body.get('best_of')!r}")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions",
                 "response_format", "logit_bias"):
        value = body.get(name)
        if value not in (None, False, {}, []) and not (name == "response_format" and
                                                       value == {"type": "text"}):
            raise invalid(name, f"{name} is not served by this endpoint")


def _stop(body: Dict[str, Any]) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("stop", "stop must be a string or a list of strings")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise invalid("stop", f"stop has {len(stop)} sequences, at most {MAX_STOP_SEQUENCES}")
    if any(s == "" for s in stop):
        raise invalid("stop", "stop sequences must not be empty")
    return stop


def _common(body: Dict[str, Any], model: str) -> Dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    requested = body.get("model")
    if not isinstance(requested, str) or not requested:
        raise invalid("model", "model is required (GET /v1/models lists it)")
    if requested != model:
        raise ApiError(404, f"The model '{requested}' does not exist; this server serves "
                       f"'{model}'", "not_found_error", "model", "model_not_found")
    _refuse_unsupported(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream", f"stream must be a boolean, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("stream_options", "stream_options must be an object")
    if options and not stream:
        raise invalid("stream_options", "stream_options is only allowed with stream: true")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("stream_options", "stream_options.include_usage must be a boolean")
    seed = _integer(body, "seed", 0, 2**64 - 1)
    # vLLM's extension, which benchmark clients send to get exactly max_tokens tokens.
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise invalid("ignore_eos", f"ignore_eos must be a boolean, got {ignore_eos!r}")
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user.encode()) > MAX_USER_BYTES):
        raise invalid("user", f"user must be a string of at most {MAX_USER_BYTES} bytes")
    return {
        "sampling": Sampling(temperature=_number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
                             top_p=_number(body, "top_p", 1.0, 0.0, 1.0), seed=seed),
        "stop": _stop(body),
        "stream": stream,
        "include_usage": include_usage,
        "user": user,
        "ignore_eos": ignore_eos,
    }


def completion_plan(body: Dict[str, Any], model: str, encode, vocab_size: int) -> Plan:
    """A /v1/completions request. prompt: a string, a list of token ids, or a list of one string
    or one list of ids (a batch of more is refused: one choice per request). encode: text -> ids.
    max_tokens defaults to 16 (OpenAI's)."""
    common = _common(body, model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "prompt must not be empty")
        ids = list(encode(prompt))
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise invalid("prompt", f"prompt token {bad} is {ids[bad]}, outside the vocabulary "
                          f"[0, {vocab_size})")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("prompt", f"a batch of {len(prompt)} prompts is not served; send one "
                      "request per prompt")
    else:
        raise invalid("prompt", "prompt must be a non-empty string or list of token ids")
    if not ids:
        raise invalid("prompt", "prompt encodes to no tokens")
    max_tokens = _integer(body, "max_tokens", 1)
    return Plan(kind="completion", model=model, prompt_ids=ids,
                max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                **common)


def _content_text(message: Dict[str, Any], index: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise invalid(f"messages[{index}].content",
                              "only text content parts ({\"type\": \"text\", \"text\": ...}) "
                              "are served")
            parts.append(part["text"])
        return "".join(parts)
    if content is None and message.get("role") == "assistant":
        return ""
    raise invalid(f"messages[{index}].content", "content must be a string or a list of text parts")


def chat_messages(body: Dict[str, Any]) -> List[Dict[str, str]]:
    """The request's messages as [{"role", "content"}], roles system (or developer), user and
    assistant; the last must not be the assistant's."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}]", "each message must be an object")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise invalid(f"messages[{i}].role",
                          f"role must be system, developer, user or assistant, got {role!r}")
        out.append({"role": role, "content": _content_text(message, i)})
    if out[-1]["role"] == "assistant":
        raise invalid("messages", "the last message must not be the assistant's")
    return out


def chat_plan(body: Dict[str, Any], model: str, render_chat, end_of_turn_id: int) -> Plan:
    """A /v1/chat/completions request. render_chat: [{"role", "content"}] -> prompt ids (the
    model's chat template, with the assistant's turn opened). max_completion_tokens (or the older
    max_tokens) bounds the answer; unset, up to the model's context. The end-of-turn token ends
    the answer."""
    common = _common(body, model)
    messages = chat_messages(body)
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    # With ignore_eos the answer runs to max_tokens past the end of its turn too (the turn's end
    # is the model's end of sequence).
    stop_token_ids = [] if common["ignore_eos"] else [end_of_turn_id]
    return Plan(kind="chat", model=model, prompt_ids=list(render_chat(messages)),
                max_tokens=max_tokens, stop_token_ids=stop_token_ids, **common)


class StopMatcher:
    """Finds the first stop string in streamed text. feed(text) returns the text that can be sent
    now (what could still begin a stop string is held back) and whether a stop string was found
    (the text before it is the last to send). finish() returns what was held back."""

    def __init__(self, stops: Sequence[str]):
        self._stops = list(stops)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self._pending += text
        first = None
        for stop in self._stops:
            at = self._pending.find(stop)
            if at >= 0 and (first is None or at < first):
                first = at
        if first is not None:
            self.stopped = True
            out, self._pending = self._pending[:first], ""
            return out
        cut = len(self._pending) - self._hold if self._stops else len(self._pending)
        out, self._pending = self._pending[:max(cut, 0)], self._pending[max(cut, 0):]
        return out

    def finish(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


class IncrementalText:
    """The text of a growing list of generated token ids, a piece at a time. add(ids) returns the
    new text; a piece that ends in the middle of a UTF-8 character (the decoder gives U+FFFD) is
    held until the next ids complete it. decode: ids -> text (special tokens skipped).

    Each add decodes only the ids since the last piece sent plus those of the piece before (the
    prefix and read offsets of vLLM's detokenizer), not the whole answer: a long answer costs the
    event loop no more per token than a short one."""

    def __init__(self, decode):
        self._decode = decode
        self._ids: List[int] = []
        self._prefix = 0  # ids before this one were sent in earlier pieces, before the last
        self._read = 0    # ids before this one were sent

    def add(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        sent = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(sent) or text.endswith("\ufffd"):
            return ""  # nothing yet, or a character still incomplete: wait for more ids
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(sent):]

    def finish(self) -> str:
        """What add held back (an incomplete character comes out as U+FFFD)."""
        sent = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(sent):]
