"""Streams a prompt's generated text from a coordinator that serves a real model (GetLoad's model
has a vocabulary, e.g. SmolLM2-135M): tokenizes the prompt with the model's tokenizer.json (the
`tokenizers` package: routers tokenize, the coordinator takes token ids), sends Generate with
context_tokens, and prints the text as its tokens arrive, then why it ended.

    python -m dsa_client.generate --target 127.0.0.1:50051 \\
        --tokenizer build/models/smollm2-135m/tokenizer.json "The capital of France is"
    python -m dsa_client.generate --target 127.0.0.1:50051 \\
        --tokenizer build/models/smollm2-135m/tokenizer.json --chat "What is the capital of France?"

`dsa generate` runs this (starting a local cluster when given no --coordinator). --chat wraps the
prompt in the ChatML template (the model's <|im_start|> and <|im_end|> inserted by id; the text
between them encoded as plain text, so a prompt cannot open or close a turn). The text goes to
stdout; the end (finish reason, token count, TTFT, inter-token latency, drafts accepted) to stderr;
--json prints one JSON line instead (prompt and generated ids, text, finish reason, timings).

Exit status: 0 when the stream ended OK; 1 when the request failed (its gRPC code and message on
stderr, e.g. INVALID_ARGUMENT for an id out of range); 2 for a usage error (no tokenizer file or
`tokenizers` package, a coordinator that serves the pattern model); 130 on Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Optional

import grpc

from dsa_client.client import CoordinatorClient, Sampling
from dsa_client.proto.dsa.coordinator.v1 import coordinator_pb2

__all__ = ["DEFAULT_SYSTEM_PROMPT", "IM_END", "IM_START", "TextStream", "chat_prompt_ids",
           "encode", "generate_text", "load_tokenizer", "main"]

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# SmolLM2's chat template's default system prompt (its GGUF; docs/model.md).
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TOKENIZER_FILE = "tokenizer.json"
FINISH_PREFIX = "FINISH_REASON_"


def load_tokenizer(path: str):
    """A `tokenizers.Tokenizer` from a tokenizer.json file, or a folder holding one. If the file
    registers added tokens, encoding treats their strings as plain text (encode_special_tokens),
    so user text never becomes a control token. Raises FileNotFoundError for a missing file and
    ImportError without the `tokenizers` package."""
    from tokenizers import Tokenizer  # the optional dependency: pip install 'dsa-client[generate]'

    if os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no tokenizer file (scripts/model_setup.sh writes the "
                                "model's tokenizer.json)")
    tokenizer = Tokenizer.from_file(path)
    if tokenizer.get_added_tokens_decoder():
        tokenizer.encode_special_tokens = True
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as plain text (no BOS or other added token)."""
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def chat_prompt_ids(tokenizer, user_text: str,
                    system_prompt: str = DEFAULT_SYSTEM_PROMPT) -> list[int]:
    """Token ids of the ChatML template for one user turn, ready for the assistant's:

        <|im_start|>system\\n{system_prompt}<|im_end|>\\n<|im_start|>user\\n{user_text}<|im_end|>\\n
        <|im_start|>assistant\\n

    <|im_start|> and <|im_end|> are inserted by their ids (tokenizer.token_to_id); the texts
    between them are encoded as plain text. Raises ValueError when the tokenizer has no such
    tokens (not a ChatML model)."""
    start, end = tokenizer.token_to_id(IM_START), tokenizer.token_to_id(IM_END)
    if start is None or end is None:
        raise ValueError(f"the tokenizer has no {IM_START} / {IM_END} tokens: --chat needs a "
                         "ChatML model")
    return [start, *encode(tokenizer, "system\n" + system_prompt), end, *encode(tokenizer, "\n"),
            start, *encode(tokenizer, "user\n" + user_text), end, *encode(tokenizer, "\n"),
            start, *encode(tokenizer, "assistant\n")]


class TextStream:
    """Incremental detokenization: feed() takes the ids of each Tokens event and returns the text
    they add. Byte-level BPE can split a character over several tokens, so a decoded tail that
    ends in U+FFFD (an incomplete UTF-8 sequence) is held back until the next ids complete it;
    flush() returns whatever is held at the end."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already returned

    def feed(self, ids: Iterable[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=False)
        if text.endswith("\ufffd"):
            return ""
        new, self._emitted = text[self._emitted:], len(text)
        return new

    def flush(self) -> str:
        text = self._tokenizer.decode(self._ids, skip_special_tokens=False)
        new, self._emitted = text[self._emitted:], len(text)
        return new

    @property
    def text(self) -> str:
        return self._tokenizer.decode(self._ids, skip_special_tokens=False)


def finish_reason_name(reason: int) -> str:
    """"EOS" for FINISH_REASON_EOS (the enum's name without its prefix)."""
    name = coordinator_pb2.FinishReason.Name(reason)
    return name[len(FINISH_PREFIX):] if name.startswith(FINISH_PREFIX) else name


def generate_text(client: CoordinatorClient, tokenizer, prompt_ids: Sequence[int], *,
                  request_id: str, max_new_tokens: int, draft_length: int = 0,
                  sampling: Optional[Sampling] = None, stop_token_ids: Sequence[int] = (),
                  ignore_eos: bool = False, eos_token_id: int = -1,
                  on_text: Optional[Callable[[str], None]] = None,
                  timeout_s: Optional[float] = None) -> dict:
    """Generates from `prompt_ids` and streams the text to on_text as it arrives. The token that
    ended the request (the model's end-of-sequence eos_token_id unless ignore_eos, or one of
    stop_token_ids) is not shown as text: it is the finish reason. Returns the summary: prompt_ids,
    token_ids (every generated id, the ending one too), text, finish_reason ("LENGTH", "EOS",
    "STOP_TOKEN"), stop_token_id, generated_tokens, ttft_s and mean_itl_s (the coordinator's
    figures), drafted and accepted (its speculative steps). Raises grpc.RpcError when the request
    fails."""
    ending = set(stop_token_ids) | (set() if ignore_eos or eos_token_id < 0 else {eos_token_id})
    stream = TextStream(tokenizer)
    token_ids: list[int] = []
    drafted = accepted = 0
    finished = None
    generation = client.generate(request_id, context_tokens=list(prompt_ids),
                                 max_new_tokens=max_new_tokens, draft_length=draft_length,
                                 sampling=sampling, stop_token_ids=stop_token_ids,
                                 ignore_eos=ignore_eos, timeout_s=timeout_s)
    try:
        for event in generation:
            kind = event.WhichOneof("event")
            if kind == "tokens":
                ids = list(event.tokens.token_ids)
                token_ids.extend(ids)
                drafted += event.tokens.drafted
                accepted += event.tokens.accepted
                text = stream.feed(i for i in ids if i not in ending)
                if text and on_text is not None:
                    on_text(text)
            elif kind == "finished":
                finished = event.finished
    except BaseException:
        generation.cancel()
        raise
    rest = stream.flush()
    if rest and on_text is not None:
        on_text(rest)
    return {
        "prompt_ids": list(prompt_ids),
        "token_ids": token_ids,
        "text": stream.text,
        "finish_reason": finish_reason_name(finished.finish_reason) if finished else "",
        "stop_token_id": (finished.stop_token_id
                          if finished is not None and finished.HasField("stop_token_id") else None),
        "generated_tokens": finished.generated_tokens if finished else len(token_ids),
        "ttft_s": finished.time_to_first_token_seconds if finished else None,
        "mean_itl_s": finished.mean_inter_token_latency_seconds if finished else None,
        "drafted": drafted,
        "accepted": accepted,
    }


def _read(path: Optional[str]) -> Optional[bytes]:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dsa_client.generate", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", help="the prompt (plain text; with --chat the user's turn)")
    parser.add_argument("--target", required=True, help="coordinator host:port")
    parser.add_argument("--tokenizer", required=True,
                        help="the model's tokenizer.json, or its folder")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in ChatML")
    parser.add_argument("--system", default=DEFAULT_SYSTEM_PROMPT,
                        help="--chat: the system prompt (default: SmolLM2's)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-length", type=int, default=2,
                        help="speculative draft length 0..4 (the coordinator's n-gram drafts)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus top-p (0 = 1)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the sampled draws (default: the coordinator picks one)")
    parser.add_argument("--stop-token-id", type=int, action="append", default=[],
                        help="end after this token id (repeat)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="go on past the model's end-of-sequence token")
    parser.add_argument("--request-id", default=None, help="default: generate-<pid>")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="deadline of the stream")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON line instead of streaming the text")
    parser.add_argument("--ca-cert", help="PEM file of the CA to trust (turns TLS on)")
    parser.add_argument("--client-cert", help="PEM certificate chain for mutual TLS")
    parser.add_argument("--client-key", help="PEM private key for mutual TLS")
    parser.add_argument("--tls-server-name", help="name expected in the server's certificate")
    parser.add_argument("--token-file", help="file holding the bearer token (needs --ca-cert)")
    return parser


def main(argv: Optional[Sequence[str]] = None, tokenizer=None) -> int:
    """The command line (see the module's doc). `tokenizer`: use this one instead of loading
    --tokenizer (tests)."""
    args = _parser().parse_args(argv)
    if tokenizer is None:
        try:
            tokenizer = load_tokenizer(args.tokenizer)
        except (OSError, ImportError) as error:
            print(f"dsa_client.generate: {error}", file=sys.stderr)
            return 2
    token = _read(args.token_file).decode().strip() if args.token_file else None
    sampling = (Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
                if args.temperature > 0 else None)
    try:
        prompt_ids = (chat_prompt_ids(tokenizer, args.prompt, args.system) if args.chat
                      else encode(tokenizer, args.prompt))
    except ValueError as error:
        print(f"dsa_client.generate: {error}", file=sys.stderr)
        return 2
    with CoordinatorClient.connect(args.target, root_certificates=_read(args.ca_cert),
                                   certificate_chain=_read(args.client_cert),
                                   private_key=_read(args.client_key), token=token,
                                   server_name=args.tls_server_name) as client:
        try:
            model = client.get_load(timeout_s=30.0).model
        except grpc.RpcError as error:
            print(f"dsa_client.generate: {args.target} did not answer GetLoad: "
                  f"{error.code().name}: {error.details()}", file=sys.stderr)
            return 1
        if model.vocab_size <= 0:
            print(f"dsa_client.generate: {args.target} serves the "
                  f"{model.name or 'pattern'} model, which generates no tokens (start the "
                  "cluster with --model smollm2)", file=sys.stderr)
            return 2
        on_text = None
        if not args.json:
            def on_text(text):
                sys.stdout.write(text)
                sys.stdout.flush()
        started = time.monotonic()
        try:
            result = generate_text(
                client, tokenizer, prompt_ids,
                request_id=args.request_id or f"generate-{os.getpid()}",
                max_new_tokens=args.max_new_tokens, draft_length=args.draft_length,
                sampling=sampling, stop_token_ids=args.stop_token_id,
                ignore_eos=args.ignore_eos, eos_token_id=model.eos_token_id, on_text=on_text,
                timeout_s=args.timeout_s)
        except grpc.RpcError as error:
            if not args.json:
                print()
            print(f"dsa_client.generate: request failed: {error.code().name}: {error.details()}",
                  file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\ndsa_client.generate: interrupted", file=sys.stderr)
            return 130
    result["model"] = model.name
    result["wall_s"] = time.monotonic() - started
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print()
    ended = result["finish_reason"] or "no Finished event"
    if result["stop_token_id"] is not None:
        ended += f" (token {result['stop_token_id']})"
    ttft = f"{result['ttft_s'] * 1e3:.0f} ms" if result["ttft_s"] is not None else "?"
    itl = f"{result['mean_itl_s'] * 1e3:.1f} ms" if result["mean_itl_s"] is not None else "?"
    print(f"[{ended} after {result['generated_tokens']} tokens of {model.name}; prompt "
          f"{len(prompt_ids)} tokens; TTFT {ttft}, mean inter-token {itl}; drafts accepted "
          f"{result['accepted']} of {result['drafted']}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
