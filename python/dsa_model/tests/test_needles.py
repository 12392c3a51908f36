"""dsa_model.needles: pass-key prompts of exactly the asked length over the Paul Graham essays,
the needle once at its recorded (sentence-snapped) position, the question last, the answer ids,
per-cell keys and byte-identical output; missing inputs exit 2 naming the path."""
import json
import os
from pathlib import Path

import pytest

from dsa_model import needles
from dsa_model.config import TOKENIZER_FILE
from dsa_model.tokenizer import decode, encode, load_tokenizer

REPO_DIR = Path(__file__).resolve().parents[3]
ESSAYS_DIR = REPO_DIR / needles.DEFAULT_ESSAYS_DIR
LENGTHS = (256, 512)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    path = Path(os.environ.get("DSA_MODEL_DIR", REPO_DIR / "build/models/smollm2-135m"))
    if not path.is_absolute():
        path = REPO_DIR / path
    if not (path / TOKENIZER_FILE).is_file():
        pytest.skip(f"{path / TOKENIZER_FILE}: no tokenizer (run scripts/model_setup.sh)")
    return path


@pytest.fixture(scope="module")
def essays_dir() -> Path:
    if not ESSAYS_DIR.is_dir():
        pytest.skip(f"{ESSAYS_DIR}: no Paul Graham essays (the shared long_docs data)")
    return ESSAYS_DIR


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def built(tokenizer_dir, essays_dir):
    text = needles.needles_json(tokenizer_dir, essays_dir, LENGTHS, DEPTHS, seed=0)
    return text, json.loads(text)


def test_header(built, tokenizer_dir, essays_dir):
    _, data = built
    assert data["format"] == "dsa-needles-v1"
    assert data["tokenizer"] == str(tokenizer_dir / TOKENIZER_FILE)
    assert data["essays"] == str(essays_dir)
    assert data["seed"] == 0
    assert data["needle_template"] == needles.NEEDLE_TEMPLATE
    assert data["question"] == "\nWhat is the pass key? The pass key is"
    assert [(c["length"], c["depth"]) for c in data["cases"]] == \
        [(n, d) for n in LENGTHS for d in DEPTHS]
    assert len(needles.essay_files(essays_dir)) == 49


def test_cases(built, tok):
    _, data = built
    question_ids = encode(tok, needles.QUESTION)
    for case in data["cases"]:
        key, tokens, at = case["passkey"], case["tokens"], case["needle_position"]
        where = f"case {case['length']}/{case['depth']}"
        assert len(key) == 5 and key.isdigit() and key[0] != "0", where
        assert len(tokens) == case["length"], where
        needle = needles.NEEDLE_TEMPLATE.format(key=key)
        needle_ids = encode(tok, needle)
        text = decode(tok, tokens)
        assert text.count(needle) == 1, where
        assert text.count("The pass key is") == 2, where      # the needle's and the question's
        assert text.count(key) == 2, where                      # both in the needle
        assert text.endswith(needles.QUESTION), where
        assert tokens[-len(question_ids):] == question_ids, where
        assert tokens[at:at + len(needle_ids)] == needle_ids, where
        assert decode(tok, tokens[at:]).startswith(needle), where
        assert case["answer_text"] == " " + key, where
        assert decode(tok, case["answer"]) == " " + key, where
        assert encode(tok, needles.QUESTION + " " + key) == question_ids + case["answer"], where
        end = case["length"] - len(question_ids) - len(needle_ids)   # the haystack budget
        if case["depth"] == 0.0:
            assert at == 0 and text.startswith(needle), where
        elif case["depth"] == 1.0:
            assert at == end, where
            assert text.endswith(needle + needles.QUESTION), where
        else:
            wanted = round(case["depth"] * end)
            assert wanted - needles.SNAP_WINDOW <= at <= wanted, where
            # The needle splits no word: white space or a line break on one side of it.
            before, after = decode(tok, tokens[:at]), decode(tok, tokens[at + len(needle_ids):])
            assert before[-1:].isspace() or after[:1].isspace() or \
                before.rstrip("\"')").endswith((".", "!", "?")), (where, before[-20:])


def test_deterministic_and_keys_per_cell(built, tokenizer_dir, essays_dir):
    text, data = built
    again = needles.needles_json(tokenizer_dir, essays_dir, LENGTHS, DEPTHS, seed=0)
    assert again == text
    keys = [c["passkey"] for c in data["cases"]]
    assert len(set(keys)) == len(keys)
    # A cell's key depends on the seed and the cell only, not on the other cells.
    alone = json.loads(needles.needles_json(tokenizer_dir, essays_dir, (512,), (0.5,), seed=0))
    assert alone["cases"][0] == data["cases"][len(DEPTHS) + 2]
    other = json.loads(needles.needles_json(tokenizer_dir, essays_dir, LENGTHS, DEPTHS, seed=1))
    assert [c["passkey"] for c in other["cases"]] != keys


def test_pass_key_is_pinned():
    assert needles.pass_key(0, 1024, 0.0) == "34392"
    assert needles.pass_key(0, 1024, 0) == needles.pass_key(0, 1024, 0.0)
    assert needles.pass_key(1, 1024, 0.0) != "34392"


def test_snap_order(tok):
    text = ("One short sentence here. Another sentence follows\nacross a wrapped "
            "antidisestablishmentarianism line")
    ids = encode(tok, text)
    # A boundary inside the long word (it is several tokens).
    at = next(k for k in range(len(ids)) if decode(tok, ids[:k]).endswith(" antidisestablish"))
    assert not decode(tok, ids[at:]).startswith(" ")

    def snapped(window):
        return decode(tok, ids[:needles.snap_position(tok, ids, at, len(ids), window=window)])

    assert snapped(needles.SNAP_WINDOW) == "One short sentence here."       # a sentence end
    assert snapped(8) == "One short sentence here. Another sentence follows\n"   # a line end
    assert snapped(3) == "One short sentence here. Another sentence follows\nacross a wrapped"
    assert snapped(1) == decode(tok, ids[:at])                             # nothing in reach
    assert needles.snap_position(tok, ids, 0, len(ids)) == 0
    assert needles.snap_position(tok, ids, len(ids), len(ids)) == len(ids)


def test_cli_writes_once(tmp_path, tokenizer_dir, essays_dir, capsys):
    out = tmp_path / "sub" / "needles.json"
    args = ["--tokenizer", str(tokenizer_dir / TOKENIZER_FILE), "--essays", str(essays_dir),
            "--out", str(out), "--lengths", "300", "--depths", "0,1"]
    assert needles.main(args) == 0
    data = json.loads(out.read_text())
    assert [(c["length"], c["depth"]) for c in data["cases"]] == [(300, 0.0), (300, 1.0)]
    mtime = out.stat().st_mtime_ns
    assert needles.main(args) == 0
    assert out.stat().st_mtime_ns == mtime
    assert "up to date" in capsys.readouterr().err


def test_length_too_short(tmp_path, tokenizer_dir, essays_dir, capsys):
    assert needles.main(["--tokenizer", str(tokenizer_dir), "--essays", str(essays_dir),
                         "--out", str(tmp_path / "n.json"), "--lengths", "30"]) == 1
    assert "length 30 cannot hold the needle" in capsys.readouterr().err
    assert not (tmp_path / "n.json").exists()


def test_missing_inputs_exit_2(tmp_path, capsys):
    missing = tmp_path / "no_essays"
    assert needles.main(["--tokenizer", str(tmp_path), "--essays", str(missing),
                         "--out", str(tmp_path / "n.json")]) == 2
    assert str(tmp_path / TOKENIZER_FILE) in capsys.readouterr().err
    (tmp_path / TOKENIZER_FILE).write_text("{}")
    assert needles.main(["--tokenizer", str(tmp_path), "--essays", str(missing),
                         "--out", str(tmp_path / "n.json")]) == 2
    assert str(missing) in capsys.readouterr().err
    assert not (tmp_path / "n.json").exists()
