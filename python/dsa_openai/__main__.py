"""python -m dsa_openai --coordinator HOST:PORT --model-dir DIR [--listen HOST:PORT] ...

Starts the OpenAI-compatible front (docs/openai.md): asks the coordinator which model it serves
(GetLoad, retried until --startup-timeout-s), loads that model's tokenizer from --model-dir
(scripts/model_setup.sh writes build/models/smollm2-135m) and serves HTTP. Prints
"dsa-openai: listening on http://HOST:PORT" once it listens. Exit 2 for bad flags or files, 1 when
the coordinator does not answer in time or serves another model."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import grpc
from aiohttp import web

from dsa_client.proto.dsa.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc

from .protocol import ApiError
from .server import FrontOptions, ModelInfo, OpenAiFront, server_ssl_context


def chatml_renderer(tokenizer, default_system_prompt: str):
    """messages -> prompt ids in SmolLM2's ChatML template (the GGUF's tokenizer.chat_template):
    each message "<|im_start|>{role}\\n{content}<|im_end|>\\n", the default system prompt first
    when the messages have none, then "<|im_start|>assistant\\n". The special tokens are inserted
    by id and the texts encoded as plain text, so message text cannot open or close a turn."""
    from dsa_model.config import IM_END, IM_START
    from dsa_model.tokenizer import encode, special_token_ids

    ids = special_token_ids(tokenizer)
    start, end = ids[IM_START], ids[IM_END]
    newline = encode(tokenizer, "\n")

    def render(messages: List[Dict[str, str]]) -> List[int]:
        if messages[0]["role"] != "system":
            messages = [{"role": "system", "content": default_system_prompt}, *messages]
        out: List[int] = []
        for message in messages:
            out += [start, *encode(tokenizer, f"{message['role']}\n{message['content']}"), end,
                    *newline]
        return out + [start, *encode(tokenizer, "assistant\n")]

    return render


def model_info(model_dir: Path, served: coordinator_pb2.Model) -> ModelInfo:
    """The served model's tokenizer and template from model_dir. Raises ValueError when its
    vocabulary is not the served model's."""
    from dsa_model.config import DEFAULT_SYSTEM_PROMPT, IM_END
    from dsa_model.tokenizer import decode, encode, load_tokenizer, special_token_ids

    tokenizer = load_tokenizer(model_dir)
    if tokenizer.get_vocab_size() != served.vocab_size:
        raise ValueError(f"{model_dir}: the tokenizer has {tokenizer.get_vocab_size()} tokens, "
                         f"the coordinator's model {served.name!r} {served.vocab_size}")
    return ModelInfo(
        name=served.name, vocab_size=served.vocab_size, max_context=served.max_context,
        encode=lambda text: encode(tokenizer, text),
        decode=lambda ids: decode(tokenizer, ids, skip_special_tokens=True),
        render_chat=chatml_renderer(tokenizer, DEFAULT_SYSTEM_PROMPT),
        end_of_turn_id=special_token_ids(tokenizer)[IM_END])


def _channel(args) -> grpc.aio.Channel:
    if args.coordinator_ca is None:
        return grpc.aio.insecure_channel(args.coordinator)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(args.coordinator_ca).read_bytes(),
        private_key=Path(args.coordinator_key).read_bytes() if args.coordinator_key else None,
        certificate_chain=Path(args.coordinator_cert).read_bytes() if args.coordinator_cert else None)
    options = []
    if args.coordinator_server_name:
        options.append(("grpc.ssl_target_name_override", args.coordinator_server_name))
    return grpc.aio.secure_channel(args.coordinator, credentials, options=options)


async def _served_model(channel: grpc.aio.Channel, token: Optional[str],
                        timeout_s: float) -> coordinator_pb2.Model:
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            load = await stub.GetLoad(coordinator_pb2.GetLoadRequest(), timeout=5,
                                      metadata=metadata)
            if load.model.vocab_size > 0:
                return load.model
            last = (f"it serves {load.model.name!r}, which has no tokens" if load.model.name else
                    "it has taken in no attention worker yet")
        except grpc.aio.AioRpcError as e:
            last = f"{e.code().name}: {e.details()}"
        await asyncio.sleep(0.5)
    raise ApiError(503, f"the coordinator at {timeout_s:g} s: {last}", "server_error")


def _startup_token(path: Optional[str]) -> Optional[str]:
    """The token in the file at path (one token, surrounding whitespace dropped), or None.
    Raises ValueError for an empty file or one holding more than a token."""
    if path is None:
        return None
    words = Path(path).read_text(encoding="utf-8").split()
    if len(words) != 1:
        raise ValueError(f"{path}: a token file holds one token, found {len(words)} words")
    return words[0]


async def _run(args) -> int:
    try:
        channel = _channel(args)
        token = _startup_token(args.startup_token_file)
    except (ValueError, OSError) as e:
        print(f"dsa-openai: {e}", file=sys.stderr)
        return 2
    try:
        served = await _served_model(channel, token, args.startup_timeout_s)
    except ApiError as e:
        print(f"dsa-openai: {e.message}", file=sys.stderr)
        return 1
    try:
        info = model_info(Path(args.model_dir), served)
        ssl_context = server_ssl_context(args.tls_cert, args.tls_key)
    except (ValueError, OSError) as e:
        print(f"dsa-openai: {e}", file=sys.stderr)
        return 2
    front = OpenAiFront(channel, info, FrontOptions(
        timeout_s=args.timeout_s, created=int(time.time()),
        forward_authorization=args.coordinator_ca is not None, health_token=token))
    # handler_cancellation: a client that disconnects cancels its handler, and so its Generate.
    # The drain on SIGTERM is the front's own (close()); the runner's cleanup then finds no
    # request left to wait for.
    runner = web.AppRunner(front.app(), access_log=None, handler_cancellation=True,
                           shutdown_timeout=0.1)
    await runner.setup()
    host, _, port = args.listen.rpartition(":")
    site = web.TCPSite(runner, host or "0.0.0.0", int(port), ssl_context=ssl_context,
                       reuse_port=False)
    try:
        await site.start()
    except OSError as e:
        print(f"dsa-openai: cannot listen on {args.listen}: {e.strerror or e}", file=sys.stderr)
        await runner.cleanup()
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    bound = runner.addresses[0]
    scheme = "https" if ssl_context else "http"
    print(f"dsa-openai: listening on {scheme}://{bound[0]}:{bound[1]} (model {info.name})",
          flush=True)
    await stop.wait()
    # SIGTERM: /health turns 503 while requests are still taken for --drain-delay-s (endpoints
    # and load balancers drop the front meanwhile), then the port closes and the requests in
    # flight get --shutdown-grace-s.
    front.start_drain()
    if args.drain_delay_s > 0:
        await asyncio.sleep(args.drain_delay_s)
    await site.stop()
    cancelled = await front.close(args.shutdown_grace_s)
    if cancelled:
        print(f"dsa-openai: cancelled {cancelled} request(s) still running after "
              f"{args.shutdown_grace_s:g} s", file=sys.stderr)
    await runner.cleanup()
    await channel.close()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="dsa-openai", description=__doc__.split("\n\n")[0])
    parser.add_argument("--coordinator", required=True, help="the coordinator's HOST:PORT")
    parser.add_argument("--model-dir", required=True,
                        help="the served model's files (its tokenizer.json)")
    parser.add_argument("--listen", default="0.0.0.0:8000", help="HOST:PORT to serve HTTP on "
                        "(port 0: any free port)")
    parser.add_argument("--tls-cert", help="PEM certificate chain of the HTTP port (HTTPS)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--coordinator-ca", help="CA bundle to dial the coordinator over TLS")
    parser.add_argument("--coordinator-server-name",
                        help="the name checked in the coordinator's certificate")
    parser.add_argument("--coordinator-cert", help="PEM client certificate shown to the coordinator "
                        "(a coordinator with --tls-client-ca: mutual TLS)")
    parser.add_argument("--coordinator-key", help="PEM private key of --coordinator-cert")
    parser.add_argument("--startup-token-file", help="file holding the bearer token of the startup "
                        "GetLoad and /health's (a coordinator with --auth-tokens-file); clients send "
                        "their own")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="deadline of each request's Generate call")
    parser.add_argument("--startup-timeout-s", type=float, default=60.0,
                        help="how long to wait for the coordinator to serve a model")
    parser.add_argument("--drain-delay-s", type=float, default=0.0,
                        help="on SIGTERM / SIGINT, how long /health answers 503 while requests "
                        "are still taken, before the port closes")
    parser.add_argument("--shutdown-grace-s", type=float, default=30.0,
                        help="then how long requests in flight may run on before they are "
                        "cancelled (0: at once)")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0 or args.startup_timeout_s <= 0:
        parser.error("--timeout-s and --startup-timeout-s must be > 0")
    if args.shutdown_grace_s < 0 or args.drain_delay_s < 0:
        parser.error("--shutdown-grace-s and --drain-delay-s must be >= 0")
    if args.startup_token_file and args.coordinator_ca is None:
        parser.error("--startup-token-file needs --coordinator-ca: tokens must not cross plaintext")
    if (args.coordinator_cert is None) != (args.coordinator_key is None):
        parser.error("--coordinator-cert and --coordinator-key go together")
    if args.coordinator_cert and args.coordinator_ca is None:
        parser.error("--coordinator-cert needs --coordinator-ca (it is shown over TLS only)")
    logging.basicConfig(level=logging.WARNING)
    return asyncio.run(_run(args))


if __name__ == "__main__":
    sys.exit(main())
