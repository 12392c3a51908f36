"""The data recipe of the real model: the reST sources of Python 3.11's documentation (Debian's
python3.11-doc package, PSF License 2.0), tokenized into a training split and a held-out split.

    python -m dsa_model.corpus --tokenizer build/models/smollm2-135m --out build/models/smollm2-135m

Files are taken in sorted relative-path order; each document's tokens are followed by EOS
(<|im_end|>, id 2); a document goes to the held-out split when the first 8 bytes of the SHA-256 of
its relative path, read big-endian, are 0-4 modulo 100 (5%), to train otherwise. Outputs: flat
uint16 .npy files and a JSON manifest. A second run with the same sources, tokenizer and recipe
version does nothing. The Paul Graham essays of ../shared/data/long_docs are evaluation-only and
never read here."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .config import (CORPUS_HELDOUT_FILE, CORPUS_MANIFEST_FILE, CORPUS_TRAIN_FILE, IM_END,
                     TOKENIZER_FILE, ModelFileError)

RECIPE_NAME = "python_docs"
RECIPE_VERSION = "1"
SOURCE_DIR = "/usr/share/doc/python3.11/html/_sources"
SOURCE_GLOB = "**/*.rst.txt"
SOURCE_PACKAGE = "python3.11-doc"
SOURCE_LICENSE = "PSF-2.0 (Python Software Foundation License Version 2)"
HELDOUT_PERCENT = 5
SPLITS = ("train", "heldout")


def split_of(relative_path: str) -> str:
    """The split of a document: "heldout" when int(sha256(relative_path)[:8 bytes], big-endian)
    % 100 < 5, else "train".
    relative_path: POSIX path under the _sources folder ("library/os.rst.txt")."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT else "train"


def source_files(source_dir: os.PathLike = SOURCE_DIR) -> List[str]:
    """Relative POSIX paths of every *.rst.txt under source_dir, sorted. Raises ModelFileError
    when the folder is missing or holds none (Debian: apt-get install python3.11-doc)."""
    root = Path(source_dir)
    if not root.is_dir():
        raise ModelFileError(f"{root}: no such folder (install Debian's {SOURCE_PACKAGE})")
    files = sorted(p.relative_to(root).as_posix() for p in root.glob(SOURCE_GLOB) if p.is_file())
    if not files:
        raise ModelFileError(f"{root}: no {SOURCE_GLOB} files (install Debian's {SOURCE_PACKAGE})")
    return files


def package_version(package: str = SOURCE_PACKAGE) -> str:
    """The installed Debian package version (`dpkg-query -W`), or "unknown" without dpkg."""
    try:
        result = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package],
                                capture_output=True, text=True, check=False)
    except OSError:
        return "unknown"
    return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else "unknown"


def _sources_digest(root: Path, files: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for name in files:
        st = (root / name).stat()
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def build_corpus(tokenizer, source_dir: os.PathLike = SOURCE_DIR
                 ) -> Tuple[Dict[str, np.ndarray], Dict[str, List[Tuple[str, int]]]]:
    """Tokenizes every source document (as plain text: a special token's string stays text)
    and splits them by `split_of`.

    Returns (tokens, documents): tokens["train"|"heldout"] is the uint16 [num_tokens]
    concatenation of each document's ids followed by EOS; documents[split] lists
    (relative path, token count including the EOS) in file order. Raises ModelFileError on a
    missing source folder, a file that is not UTF-8, or an id beyond uint16."""
    from .tokenizer import encode_batch

    root = Path(source_dir)
    files = source_files(root)
    texts = []
    for name in files:
        try:
            texts.append((root / name).read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ModelFileError(f"{root / name}: not UTF-8: {e}") from e
    eos = tokenizer.token_to_id(IM_END)
    pieces: Dict[str, List[np.ndarray]] = {s: [] for s in SPLITS}
    documents: Dict[str, List[Tuple[str, int]]] = {s: [] for s in SPLITS}
    for name, ids in zip(files, encode_batch(tokenizer, texts)):
        ids = np.asarray(ids + [eos], dtype=np.int64)
        if ids.max() > np.iinfo(np.uint16).max:
            raise ModelFileError(f"{root / name}: token id {ids.max()} does not fit uint16")
        split = split_of(name)
        pieces[split].append(ids.astype(np.uint16))
        documents[split].append((name, int(ids.size)))
    tokens = {s: np.concatenate(pieces[s]) if pieces[s] else np.zeros(0, np.uint16)
              for s in SPLITS}
    return tokens, documents


def _expected_stamp(tokenizer_dir: Path, source_dir: Path) -> dict:
    from .convert import file_sha256

    files = source_files(source_dir)
    return {"recipe_version": RECIPE_VERSION,
            "tokenizer_sha256": file_sha256(tokenizer_dir / TOKENIZER_FILE),
            "source_dir": str(source_dir), "sources_sha256": _sources_digest(source_dir, files),
            "package": SOURCE_PACKAGE, "package_version": package_version()}


def is_up_to_date(out_dir: os.PathLike, stamp: dict) -> bool:
    """Whether out_dir's manifest carries `stamp` and both .npy files have the sizes it records."""
    out_dir = Path(out_dir)
    try:
        manifest = json.loads((out_dir / CORPUS_MANIFEST_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if manifest.get("stamp") != stamp:
        return False
    for split, name in (("train", CORPUS_TRAIN_FILE), ("heldout", CORPUS_HELDOUT_FILE)):
        path = out_dir / name
        if not path.is_file() or path.stat().st_size != manifest["splits"][split]["file_bytes"]:
            return False
    return True


def _save_npy(array: np.ndarray, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def write_corpus(tokenizer_dir: os.PathLike, out_dir: os.PathLike,
                 source_dir: os.PathLike = SOURCE_DIR, force: bool = False) -> bool:
    """Builds the corpus with `tokenizer_dir/tokenizer.json` into out_dir (python_docs_train.npy,
    python_docs_heldout.npy, python_docs_manifest.json) unless it is up to date.

    Returns True when it wrote, False when it skipped. Raises ModelFileError on a missing
    tokenizer or source folder."""
    from .tokenizer import load_tokenizer

    tokenizer_dir, out_dir, source_dir = Path(tokenizer_dir), Path(out_dir), Path(source_dir)
    if not (tokenizer_dir / TOKENIZER_FILE).is_file():
        raise ModelFileError(f"{tokenizer_dir / TOKENIZER_FILE}: no such file (run "
                             f"python -m dsa_model.convert first)")
    stamp = _expected_stamp(tokenizer_dir, source_dir)
    if not force and is_up_to_date(out_dir, stamp):
        return False
    tokens, documents = build_corpus(load_tokenizer(tokenizer_dir), source_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CORPUS_MANIFEST_FILE).unlink(missing_ok=True)
    splits = {}
    for split, name in (("train", CORPUS_TRAIN_FILE), ("heldout", CORPUS_HELDOUT_FILE)):
        _save_npy(tokens[split], out_dir / name)
        splits[split] = {"file": name, "dtype": "uint16", "tokens": int(tokens[split].size),
                         "documents": len(documents[split]),
                         "file_bytes": (out_dir / name).stat().st_size,
                         "files": [[path, count] for path, count in documents[split]]}
    manifest = {
        "recipe": RECIPE_NAME,
        "recipe_version": RECIPE_VERSION,
        "description": "reST sources of the Python 3.11 documentation; each document's tokens "
                       "then EOS, files in sorted path order; split by "
                       "sha256(relative path)[:8] big-endian % 100 < 5 -> heldout",
        "source": f"{source_dir}/{SOURCE_GLOB}",
        "license": SOURCE_LICENSE,
        "eos_token_id": load_tokenizer(tokenizer_dir).token_to_id(IM_END),
        "stamp": stamp,
        "splits": splits,
    }
    (out_dir / CORPUS_MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return True


def load_split(model_dir: os.PathLike, split: str) -> np.ndarray:
    """The uint16 token array of a split ("train" or "heldout") written by `write_corpus`.
    Raises ModelFileError when it is missing; ValueError on an unknown split."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}, expected one of {SPLITS}")
    path = Path(model_dir) / (CORPUS_TRAIN_FILE if split == "train" else CORPUS_HELDOUT_FILE)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file (run scripts/model_setup.sh)")
    array = np.load(path, mmap_mode="r")
    if array.dtype != np.uint16 or array.ndim != 1:
        raise ModelFileError(f"{path}: {array.dtype} {array.shape}, expected flat uint16")
    return array


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI: python -m dsa_model.corpus --tokenizer DIR --out DIR [--sources DIR] [--force]."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="folder holding tokenizer.json")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--sources", default=SOURCE_DIR, help="the _sources folder")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    args = parser.parse_args(argv)
    try:
        wrote = write_corpus(args.tokenizer, args.out, args.sources, args.force)
    except ModelFileError as e:
        print(f"dsa_model.corpus: {e}", file=sys.stderr)
        return 1
    manifest = json.loads((Path(args.out) / CORPUS_MANIFEST_FILE).read_text())
    counts = ", ".join(f"{s} {manifest['splits'][s]['tokens']} tokens in "
                       f"{manifest['splits'][s]['documents']} files" for s in SPLITS)
    print(f"dsa_model.corpus: {args.out}: {'written' if wrote else 'up to date'} ({counts})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
