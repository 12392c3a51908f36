"""Pass-key retrieval prompts for the real model (Mohtashami & Jaggi 2023, "Landmark Attention";
the needle-in-a-haystack test): a 5-digit pass key hidden at a chosen depth of a long haystack of
Paul Graham's essays, followed by a question whose answer is the key.

    python -m dsa_model.needles --tokenizer build/models/smollm2-135m \\
        --essays ../shared/data/long_docs/PaulGrahamEssays \\
        --out build/models/smollm2-135m/needles.json

The recipe, per (length L, depth d) cell, all in token ids of the model's tokenizer (plain text,
no BOS: SmolLM2 prepends none):

- haystack: the essays (*.txt of the folder, LICENSE* files excepted) in sorted file-name order,
  each stripped of surrounding whitespace, joined by a blank line, tokenized once;
- needle: NEEDLE_TEMPLATE with the cell's key; question: QUESTION;
- the haystack budget H = L - len(needle ids) - len(question ids) tokens is taken from the start
  of the haystack; the needle goes in at token round(d * H), snapped back to the nearest earlier
  token boundary within SNAP_WINDOW tokens that ends a sentence or paragraph, else to the
  nearest earlier one that ends a line, else a word (`snap_position`), else left where it is, so
  that it splits no word; position 0 (d = 0) and position H (d = 1: the needle right before the
  question) are never moved;
- tokens = haystack[:p] + needle + haystack[p:H] + question, exactly L ids;
- answer = the ids of encode(question + " " + key) after encode(question), which with SmolLM2's
  digit-by-digit pre-tokenizer is their prefix (the answer is " " then one id per digit; a
  tokenizer for which it is not gets encode(" " + key)); answer_text = " " + key;
- the key: random.Random(int.from_bytes(sha256(f"{seed}/{L}/{d!r}")[:8], "big")).randint(10000,
  99999), so a cell's key depends on the seed and the cell only (not on the other cells).

The same inputs give a byte-identical file; a run whose output equals the existing file leaves
it untouched. The essays (copyright Paul Graham) are read at run time only; only token ids go
into the output. Exit status 0; 2 when the tokenizer or the essays folder is missing; 1 when a
length cannot hold the needle and the question, or the haystack is too short."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .config import DEFAULT_MODEL_DIR, TOKENIZER_FILE, ModelFileError

FORMAT = "dsa-needles-v1"
NEEDLE_TEMPLATE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
# The longest is 8K less room for the answer: the prompt and the 5 fed answer tokens must fit
# SmolLM2's 8,192 positions.
DEFAULT_LENGTHS: Tuple[int, ...] = (1024, 2048, 4096, 8184)
DEFAULT_DEPTHS: Tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_SEED = 0
DEFAULT_ESSAYS_DIR = "../shared/data/long_docs/PaulGrahamEssays"
DEFAULT_OUT = f"{DEFAULT_MODEL_DIR}/needles.json"
SNAP_WINDOW = 64
_SENTENCE_ENDS = ".!?"
_CLOSERS = "\"')]}\u201d\u2019"


class MissingInputError(ModelFileError):
    """The tokenizer file or the essays folder does not exist (the CLI exits 2)."""


def essay_files(essays_dir: os.PathLike) -> List[Path]:
    """The essays of the folder: its *.txt files except LICENSE*, sorted by file name. Raises
    MissingInputError when the folder is missing, ModelFileError when it holds no essay."""
    root = Path(essays_dir)
    if not root.is_dir():
        raise MissingInputError(f"{root}: no such folder (the Paul Graham essays)")
    files = sorted((p for p in root.glob("*.txt")
                    if p.is_file() and not p.name.upper().startswith("LICENSE")),
                   key=lambda p: p.name)
    if not files:
        raise ModelFileError(f"{root}: no *.txt essays")
    return files


def haystack_text(essays_dir: os.PathLike) -> str:
    """The essays in sorted file-name order, each stripped, joined by a blank line. Raises
    ModelFileError naming a file that is not UTF-8."""
    texts = []
    for path in essay_files(essays_dir):
        try:
            texts.append(path.read_text(encoding="utf-8").strip())
        except UnicodeDecodeError as e:
            raise ModelFileError(f"{path}: not UTF-8: {e}") from e
    return "\n\n".join(texts)


def tokenizer_file(path: os.PathLike) -> Path:
    """The tokenizer.json a --tokenizer argument names: the file itself or `path/tokenizer.json`.
    Raises MissingInputError when it does not exist, ModelFileError when a file is not named
    tokenizer.json (dsa_model.tokenizer.load_tokenizer reads a folder's tokenizer.json)."""
    path = Path(path)
    file = path if path.is_file() else path / TOKENIZER_FILE
    if not file.is_file():
        raise MissingInputError(f"{file}: no such file (run scripts/model_setup.sh)")
    if file.name != TOKENIZER_FILE:
        raise ModelFileError(f"{file}: expected a file named {TOKENIZER_FILE} or its folder")
    return file


def pass_key(seed: int, length: int, depth: float) -> str:
    """The cell's 5-digit key ("10000".."99999"), from random.Random seeded with the first 8
    bytes (big-endian) of sha256(f"{seed}/{length}/{depth!r}")."""
    digest = hashlib.sha256(f"{seed}/{int(length)}/{float(depth)!r}".encode()).digest()
    return str(random.Random(int.from_bytes(digest[:8], "big")).randint(10000, 99999))


def _ends_sentence(text: str) -> bool:
    return text.rstrip(_CLOSERS).endswith(tuple(_SENTENCE_ENDS))


def snap_position(tokenizer, haystack: Sequence[int], position: int, end: int,
                  window: int = SNAP_WINDOW) -> int:
    """The needle's token position for the wanted `position` in haystack[:end]: unchanged when
    0 or `end`; else the largest b in [position - window, position] that lies in white space
    (the text before b ends with it or haystack[b] starts with it) after the end of a sentence
    (., ! or ?, optionally then closing quotes or brackets) or at a paragraph break (two line
    breaks); else the largest b right after a line break; else the largest b that starts a word
    (haystack[b] starts with white space); else `position`. The essays are hard-wrapped, so a
    line break alone often falls mid-sentence: sentence ends come first."""
    if position <= 0 or position >= end:
        return max(0, min(position, end))
    lo = max(0, position - window)
    first = max(0, lo - 8)
    pieces = [tokenizer.decode([int(t)]) for t in haystack[first:position + 1]]
    candidates = []
    for b in range(position, lo - 1, -1):
        before = "".join(pieces[:b - first])
        after = pieces[b - first]
        stripped = before.rstrip()
        gap = before[len(stripped):] + after[:len(after) - len(after.lstrip())]
        in_space = b == 0 or bool(gap)
        candidates.append((b, in_space and (b == 0 or _ends_sentence(stripped) or "\n\n" in gap),
                           b == 0 or before.endswith("\n"), in_space))
    for rule in (1, 2, 3):
        for candidate in candidates:
            if candidate[rule]:
                return candidate[0]
    return position


def answer_ids(tokenizer, key: str) -> List[int]:
    """The ids that continue encode(QUESTION) into encode(QUESTION + " " + key) when
    encode(QUESTION) is their prefix (SmolLM2's tokenizer: always, the digits being split one
    by one); otherwise, for a tokenizer that merges across that seam, encode(" " + key)."""
    from .tokenizer import encode

    question = encode(tokenizer, QUESTION)
    full = encode(tokenizer, QUESTION + " " + key)
    if full[:len(question)] == question:
        return full[len(question):]
    return encode(tokenizer, " " + key)


def build_cases(tokenizer, haystack: Sequence[int], lengths: Sequence[int],
                depths: Sequence[float], seed: int = DEFAULT_SEED) -> List[Dict]:
    """One case per (length, depth), lengths outer, in the given orders (see the module's
    docstring). Raises ValueError when a length cannot hold the needle, the question and at
    least one haystack token, or the haystack is shorter than a length needs."""
    from .tokenizer import decode, encode

    question = encode(tokenizer, QUESTION)
    cases = []
    for length in lengths:
        for depth in depths:
            length, depth = int(length), float(depth)
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"depth {depth} is outside [0, 1]")
            key = pass_key(seed, length, depth)
            needle_text = NEEDLE_TEMPLATE.format(key=key)
            needle = encode(tokenizer, needle_text)
            budget = length - len(needle) - len(question)
            if budget < 1:
                raise ValueError(f"length {length} cannot hold the needle ({len(needle)} tokens) "
                                 f"and the question ({len(question)} tokens) and a haystack")
            if budget > len(haystack):
                raise ValueError(f"length {length} needs {budget} haystack tokens, the essays "
                                 f"give {len(haystack)}")
            position = snap_position(tokenizer, haystack, round(depth * budget), budget)
            tokens = [int(t) for t in haystack[:position]] + needle + \
                [int(t) for t in haystack[position:budget]] + question
            assert len(tokens) == length
            answer = answer_ids(tokenizer, key)
            assert decode(tokenizer, answer) == " " + key
            cases.append({"length": length, "depth": depth, "passkey": key,
                          "needle_position": position, "tokens": tokens, "answer": answer,
                          "answer_text": " " + key})
    return cases


def to_json(header: Dict, cases: Sequence[Dict]) -> str:
    """The file's text: the header fields one per line, then "cases" with one case per line."""
    lines = ["{"]
    lines += [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in header.items()]
    lines.append(' "cases": [')
    lines += [" " + json.dumps(c, separators=(",", ":")) + ("," if i + 1 < len(cases) else "")
              for i, c in enumerate(cases)]
    lines += [" ]", "}"]
    return "\n".join(lines) + "\n"


def needles_json(tokenizer_path: os.PathLike, essays_dir: os.PathLike,
                 lengths: Sequence[int] = DEFAULT_LENGTHS,
                 depths: Sequence[float] = DEFAULT_DEPTHS, seed: int = DEFAULT_SEED) -> str:
    """The dsa-needles-v1 file's text for the tokenizer (a folder or its tokenizer.json) and the
    essays folder. Raises MissingInputError, ModelFileError or ValueError (see build_cases)."""
    from .tokenizer import encode, load_tokenizer

    file = tokenizer_file(tokenizer_path)
    text = haystack_text(essays_dir)
    tokenizer = load_tokenizer(file.parent)
    cases = build_cases(tokenizer, encode(tokenizer, text), lengths, depths, seed)
    header = {"format": FORMAT, "tokenizer": str(file), "essays": str(essays_dir),
              "seed": int(seed), "needle_template": NEEDLE_TEMPLATE, "question": QUESTION}
    return to_json(header, cases)


def write_needles(out: os.PathLike, text: str) -> bool:
    """Writes `text` to `out` (atomically) unless the file already holds it; True when written."""
    out = Path(out)
    if out.is_file() and out.read_text() == text:
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    return True


def _int_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: lengths must be positive")
    return values


def _float_list(text: str) -> List[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers")
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: depths must lie in [0, 1]")
    return values


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI: python -m dsa_model.needles --tokenizer DIR_OR_FILE --essays DIR --out FILE
    [--lengths 1024,2048,...] [--depths 0,0.25,...] [--seed 0]."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=DEFAULT_MODEL_DIR,
                        help="folder holding tokenizer.json, or the file")
    parser.add_argument("--essays", default=DEFAULT_ESSAYS_DIR,
                        help="folder of the Paul Graham essays (*.txt)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="output JSON file")
    parser.add_argument("--lengths", type=_int_list, default=list(DEFAULT_LENGTHS),
                        help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--depths", type=_float_list, default=list(DEFAULT_DEPTHS),
                        help="needle depths in [0, 1], comma-separated")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="pass-key seed")
    args = parser.parse_args(argv)
    try:
        text = needles_json(args.tokenizer, args.essays, args.lengths, args.depths, args.seed)
    except MissingInputError as e:
        print(f"dsa_model.needles: {e}", file=sys.stderr)
        return 2
    except (ModelFileError, ValueError) as e:
        print(f"dsa_model.needles: {e}", file=sys.stderr)
        return 1
    wrote = write_needles(args.out, text)
    print(f"dsa_model.needles: {args.out}: {'written' if wrote else 'up to date'} "
          f"({len(args.lengths) * len(args.depths)} cases, lengths "
          f"{','.join(map(str, args.lengths))}, depths {','.join(map(str, args.depths))})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
