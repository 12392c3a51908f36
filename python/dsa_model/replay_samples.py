"""Decodes the sample outputs of a real-model replay report (`dsa replay --model smollm2 --json`:
its "samples", each request's generated token ids and the last ids of its context) with the
model's tokenizer, prints them, and with --markdown appends them to the report's markdown.

    python -m dsa_model.replay_samples docs/results/replay_mooncake_smollm2.json \\
        --tokenizer build/models/smollm2-135m --markdown docs/results/replay_mooncake_smollm2.md

Exit status 0; 1 when the report has no samples (not a real-model replay)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

from .config import DEFAULT_MODEL_DIR
from .tokenizer import decode, load_tokenizer

MARKDOWN_HEADING = "### Sample outputs, decoded"


def decoded_samples(report: Dict, tokenizer) -> List[Dict]:
    """Per sample: index, status, finish_reason, context_tokens, and the decoded context_tail and
    output (special tokens shown as their strings, e.g. <|im_end|>)."""
    out = []
    for sample in report.get("samples", []):
        out.append({
            "index": sample["index"],
            "status": sample["status"],
            "finish_reason": sample.get("finish_reason") or "-",
            "context_tokens": sample["context_tokens"],
            "generated_tokens": len(sample["token_ids"]),
            "context_tail": decode(tokenizer, sample["context_tail_ids"]),
            "output": decode(tokenizer, sample["token_ids"]),
        })
    return out


def to_text(samples: List[Dict]) -> str:
    lines = []
    for s in samples:
        lines.append(f"--- request {s['index']} ({s['status']}, {s['context_tokens']}-token "
                     f"context, {s['generated_tokens']} generated, finish {s['finish_reason']})")
        lines.append(f"... {s['context_tail']}")
        lines.append(f">>> {s['output']}")
    return "\n".join(lines) + "\n"


def to_markdown(samples: List[Dict]) -> str:
    parts = [f"\n{MARKDOWN_HEADING}\n\nEach request's context ends with the text after `...`; "
             "the model's continuation (the report's sampling) follows `>>>` (decoded by "
             "`python -m dsa_model.replay_samples`).\n"]
    for s in samples:
        parts.append(f"\nRequest {s['index']} ({s['status']}, {s['context_tokens']}-token "
                     f"context, {s['generated_tokens']} tokens generated, finish "
                     f"{s['finish_reason']}):\n\n````text\n... {s['context_tail']}\n>>> "
                     f"{s['output']}\n````\n")
    return "".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="the replay's JSON report")
    parser.add_argument("--tokenizer", type=Path, default=Path(DEFAULT_MODEL_DIR),
                        help="folder of the model's tokenizer.json")
    parser.add_argument("--markdown", type=Path,
                        help="append the decoded samples to this markdown file (a section "
                             "written by an earlier run is replaced)")
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    tokenizer = load_tokenizer(args.tokenizer)
    samples = decoded_samples(report, tokenizer)
    if not samples:
        print(f"{args.report}: no samples (a real-model replay writes them)", file=sys.stderr)
        return 1
    sys.stdout.write(to_text(samples))
    if args.markdown is not None:
        text = args.markdown.read_text() if args.markdown.exists() else ""
        at = text.find("\n" + MARKDOWN_HEADING)
        if at >= 0:
            text = text[:at] + "\n"
        args.markdown.write_text(text.rstrip("\n") + "\n" + to_markdown(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
