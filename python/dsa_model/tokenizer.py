"""SmolLM2's tokenizer rebuilt from the GGUF alone (docs/model.md, "The backbone"), with encoding
that never turns user text into control tokens, and the ChatML prompt of the GGUF's chat template.

The saved tokenizer.json registers no added tokens: the 17 special tokens (ids 0-16) live in the
BPE vocabulary only, so any loader encodes a special token's string as plain text; prompts insert
the specials by id (`special_token_ids`, `chat_prompt`)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Iterable, List, Sequence

from .config import (DEFAULT_SYSTEM_PROMPT, IM_END, IM_START, SPECIAL_TOKENS, TOKENIZER_FILE,
                     ModelFileError)

GGUF_TOKENIZER_MODEL = "gpt2"
GGUF_PRE_TOKENIZER = "smollm"
_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def _build(vocab: Dict[str, int], merges: Sequence[tuple]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), ignore_merges=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def tokenizer_from_gguf(path: os.PathLike):
    """A `tokenizers.Tokenizer` from the GGUF's tokenizer.ggml.* fields: byte-level BPE (vocab and
    merges), pre-tokenizer Digits(individual_digits=True) then ByteLevel(add_prefix_space=False,
    use_regex=True) (llama.cpp's "smollm" pre-tokenizer: \\p{N}, then the GPT-2 regex), ByteLevel
    decoder, no normalizer, no post-processor (no BOS prepended), no added tokens.

    Raises ModelFileError (naming the file) when the GGUF is not a gpt2/smollm tokenizer or its
    control tokens are not the 17 of config.SPECIAL_TOKENS at ids 0-16."""
    from .convert import open_gguf

    path = Path(path)
    reader = open_gguf(path)

    def field(key):
        if key not in reader.fields:
            raise ModelFileError(f"{path}: GGUF metadata has no '{key}'")
        return reader.fields[key].contents()

    model, pre = field("tokenizer.ggml.model"), field("tokenizer.ggml.pre")
    if model != GGUF_TOKENIZER_MODEL or pre != GGUF_PRE_TOKENIZER:
        raise ModelFileError(f"{path}: tokenizer is {model!r}/{pre!r}, expected "
                             f"{GGUF_TOKENIZER_MODEL!r}/{GGUF_PRE_TOKENIZER!r}")
    tokens = field("tokenizer.ggml.tokens")
    token_types = field("tokenizer.ggml.token_type")
    merges_text = field("tokenizer.ggml.merges")
    specials = [(i, t) for i, (t, kind) in enumerate(zip(tokens, token_types))
                if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)]
    if specials != list(enumerate(SPECIAL_TOKENS)):
        raise ModelFileError(f"{path}: control/user-defined tokens are {specials[:20]}, expected "
                             f"{len(SPECIAL_TOKENS)} at ids 0..{len(SPECIAL_TOKENS) - 1}: "
                             f"{list(SPECIAL_TOKENS)}")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelFileError(f"{path}: tokenizer.ggml.tokens has duplicate entries")
    merges = []
    for line in merges_text:
        pair = tuple(line.split(" "))
        if len(pair) != 2:
            raise ModelFileError(f"{path}: merge {line!r} is not two tokens separated by a space")
        merges.append(pair)
    return _build(vocab, merges)


def load_tokenizer(model_dir: os.PathLike):
    """Loads `model_dir/tokenizer.json` and checks the special tokens' ids.

    If the file registers added tokens (one not written by this module), encoding is switched
    to treat their strings as plain text (`encode_special_tokens = True`). Raises ModelFileError
    naming the file when it is missing or its vocabulary lacks a special token at its id."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file (run scripts/model_setup.sh)")
    tokenizer = Tokenizer.from_file(str(path))
    if tokenizer.get_added_tokens_decoder():
        tokenizer.encode_special_tokens = True
    for i, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != i:
            raise ModelFileError(f"{path}: token {token!r} has id {tokenizer.token_to_id(token)}, "
                                 f"expected {i}")
    return tokenizer


def special_token_ids(tokenizer) -> Dict[str, int]:
    """The 17 special tokens' ids by string ({"<|endoftext|>": 0, "<|im_start|>": 1, ...})."""
    return {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}


def _plain(tokenizer):
    if tokenizer.get_added_tokens_decoder() and not tokenizer.encode_special_tokens:
        tokenizer.encode_special_tokens = True
    return tokenizer


def encode(tokenizer, text: str) -> List[int]:
    """Token ids of `text` as plain text: a special token's string in it becomes ordinary BPE
    tokens, never the control token; no BOS is prepended (docs/model.md)."""
    return _plain(tokenizer).encode(text, add_special_tokens=False).ids


def encode_batch(tokenizer, texts: Iterable[str]) -> List[List[int]]:
    """`encode` over many texts (the tokenizers package's threads)."""
    return [e.ids for e in _plain(tokenizer).encode_batch(list(texts), add_special_tokens=False)]


def decode(tokenizer, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    """Text of token ids (byte-level decoding). With skip_special_tokens, ids 0-16 are dropped;
    otherwise they come out as their strings ("<|im_end|>")."""
    ids = [int(i) for i in ids]
    if skip_special_tokens:
        ids = [i for i in ids if i >= len(SPECIAL_TOKENS)]
    return tokenizer.decode(ids, skip_special_tokens=False)


def chat_prompt(tokenizer, user_text: str, system_prompt: str = DEFAULT_SYSTEM_PROMPT,
                add_generation_prompt: bool = True) -> List[int]:
    """Token ids of the GGUF's ChatML template for one user turn:

        <|im_start|>system\\n{system_prompt}<|im_end|>\\n<|im_start|>user\\n{user_text}<|im_end|>\\n
        <|im_start|>assistant\\n

    The specials are inserted by id; the texts between them are encoded as plain text (as a
    tokenizer that splits on its added tokens would), so user text cannot open or close a turn."""
    ids = special_token_ids(tokenizer)
    start, end = ids[IM_START], ids[IM_END]
    out = [start, *encode(tokenizer, "system\n" + system_prompt), end, *encode(tokenizer, "\n"),
           start, *encode(tokenizer, "user\n" + user_text), end, *encode(tokenizer, "\n")]
    if add_generation_prompt:
        out += [start, *encode(tokenizer, "assistant\n")]
    return out
