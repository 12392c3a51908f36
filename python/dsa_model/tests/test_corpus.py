"""Corpus tests: the manifest agrees with the .npy files, the split is by document and
deterministic, and every document ends with exactly one EOS (docs/model.md's data recipe)."""
import json

import numpy as np

from dsa_model.config import CORPUS_MANIFEST_FILE
from dsa_model.corpus import SPLITS, load_split, source_files, split_of


def test_manifest_matches_files(model_dir):
    manifest = json.loads((model_dir / CORPUS_MANIFEST_FILE).read_text())
    names = {s: [f for f, _ in manifest["splits"][s]["files"]] for s in SPLITS}
    assert not set(names["train"]) & set(names["heldout"])
    assert sorted(names["train"] + names["heldout"]) == source_files(manifest["stamp"]["source_dir"])
    for split in SPLITS:
        tokens = load_split(model_dir, split)
        entry = manifest["splits"][split]
        assert tokens.size == entry["tokens"] == sum(n for _, n in entry["files"])
        assert int(np.count_nonzero(tokens == manifest["eos_token_id"])) == entry["documents"]
        assert all(split_of(f) == split for f in names[split])
        assert names[split] == sorted(names[split])
    held = manifest["splits"]["heldout"]["documents"]
    total = held + manifest["splits"]["train"]["documents"]
    assert 0.02 < held / total < 0.10


def test_split_is_by_path_hash():
    assert split_of("library/argparse.rst.txt") == "heldout"
    assert split_of("library/os.rst.txt") == "train"
