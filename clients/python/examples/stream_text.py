"""Example of dsa_client against a coordinator that serves a real model (`dsa up --model smollm2`):
reads the model from GetLoad, tokenizes a prompt with the model's tokenizer.json (the `tokenizers`
package: routers tokenize), streams Generate and prints the text as its token ids arrive, then the
finish reason. With --json, one JSON summary line at the end (the cluster test reads it).

    python examples/stream_text.py --target 127.0.0.1:50051 \\
        --tokenizer build/models/smollm2-135m/tokenizer.json "The capital of France is"
    python examples/stream_text.py --target 127.0.0.1:50051 --tokenizer ... --chat \\
        --temperature 0.7 --seed 3 "Write a haiku about the sea."

Exit status: 0 when the stream ended OK, 1 otherwise.
"""

import argparse
import json
import os
import sys

import grpc

# Run from a checkout without installing: the package is one folder up.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsa_client import CoordinatorClient, Sampling  # noqa: E402
from dsa_client.generate import (TextStream, chat_prompt_ids, encode,  # noqa: E402
                                 finish_reason_name, load_tokenizer)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt")
    parser.add_argument("--target", required=True, help="coordinator host:port")
    parser.add_argument("--tokenizer", required=True, help="the model's tokenizer.json")
    parser.add_argument("--chat", action="store_true", help="ChatML prompt (a user turn)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print a JSON summary line last")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.tokenizer)
    with CoordinatorClient.connect(args.target) as client:
        model = client.get_load().model          # what to tokenize for
        print(f"model: {model.name} (vocabulary {model.vocab_size}, eos {model.eos_token_id})",
              file=sys.stderr)
        prompt = (chat_prompt_ids(tokenizer, args.prompt) if args.chat
                  else encode(tokenizer, args.prompt))
        generation = client.generate(
            f"example-text-{os.getpid()}", context_tokens=prompt,
            max_new_tokens=args.max_new_tokens, draft_length=2,
            sampling=Sampling(temperature=args.temperature, seed=args.seed))
        stream = TextStream(tokenizer)
        ids = []
        try:
            for token_id in generation.token_ids():
                ids.append(token_id)
                if token_id != model.eos_token_id:   # the end token is the finish reason
                    sys.stdout.write(stream.feed([token_id]))
                    sys.stdout.flush()
        except grpc.RpcError as error:
            print(f"\nfailed: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
        sys.stdout.write(stream.flush() + "\n")
        reason = finish_reason_name(generation.finished.finish_reason)
        print(f"[{reason} after {len(ids)} tokens; TTFT "
              f"{generation.finished.time_to_first_token_seconds * 1e3:.0f} ms]", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": model.name, "prompt_ids": prompt, "token_ids": ids,
                          "text": stream.text, "finish_reason": reason}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
