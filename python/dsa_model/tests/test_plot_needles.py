"""dsa_model.plot_needles: merging the needle cells of several eval reports (later file wins,
said on stderr; several cases of one cell give a fraction), the panel order, the PNG, the
--text table, and bad inputs exiting 2 with one line naming the file."""
import json

import pytest

from dsa_model import plot_needles


def cell(arm, length, depth, found):
    return {"arm": arm, "length": length, "depth": depth, "found": found, "generated": [1, 2]}


def write(tmp_path, name, needles, arms=("dense", "spin", "spec")):
    # options.arms as the eval writes it: objects with a name (plot_needles also takes strings).
    report = {"device": "cpu", "options": {"arms": [{"name": a} for a in arms]},
              "needles": needles}
    path = tmp_path / name
    path.write_text(json.dumps(report))
    return str(path)


@pytest.fixture
def two_reports(tmp_path):
    # a: 1K for both arms; b: 2K, and a rerun of spin's 1K depth 0 (missed this time). The
    # "spec" arm has no cells and is left out; "dense" has two cases at 2K depth 0.5.
    a = write(tmp_path, "a.json", [cell("spin", 1024, 0.0, True), cell("spin", 1024, 1.0, True),
                                   cell("dense", 1024, 0.0, True), cell("dense", 1024, 1.0, False)])
    b = write(tmp_path, "b.json", [cell("dense", 2048, 0.5, True), cell("dense", 2048, 0.5, False),
                                   cell("spin", 1024, 0.0, False)], arms=["spin", "dense"])
    return a, b


def test_merge_grid(two_reports):
    a, b = two_reports
    merged = plot_needles.merge([(p, plot_needles.load_report(p)) for p in (a, b)])
    assert merged.arms == ["dense", "spin"]  # the first report's order, "spec" left out
    assert merged.lengths == [1024, 2048]
    assert merged.depths == [0.0, 0.5, 1.0]
    assert merged.counts[("spin", 1024, 0.0)] == (0, 1)  # b's rerun replaced a's
    assert merged.counts[("dense", 2048, 0.5)] == (1, 2)
    assert plot_needles.fraction_grid(merged, "dense") == [[1.0, None], [None, 0.5],
                                                            [0.0, None]]
    assert plot_needles.fraction_grid(merged, "spin") == [[0.0, None], [None, None],
                                                           [1.0, None]]
    assert merged.notes == [f"{b} replaces 1 needle cell(s) of {a} (same arm, length and depth)"]


def test_png(two_reports, tmp_path, capsys):
    pytest.importorskip("matplotlib")  # in scripts/requirements-model.txt; --text needs none
    out = tmp_path / "needles.png"
    assert plot_needles.main([*two_reports, "--out", str(out), "--title", "t"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 1000
    assert "replaces 1 needle cell(s)" in capsys.readouterr().err


def test_text(two_reports, tmp_path, capsys):
    empty = write(tmp_path, "empty.json", [])  # pass keys skipped: adds nothing, noted
    assert plot_needles.main([*two_reports, empty, "--text"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ("| arm | 1K | 2K |\n"
                            "|---|---:|---:|\n"
                            "| dense | 1/2 | 1/2 |\n"
                            "| spin | 1/2 | - |\n")
    assert f"{empty}: no needle cells" in captured.err


@pytest.mark.parametrize("content, problem", [
    (None, "no such file"),
    ("{not json", "not JSON"),
    (json.dumps({"options": {}}), "no 'needles' key"),
    (json.dumps({"needles": [{"arm": "dense", "length": 1024}]}), "needles[0] lacks"),
    (json.dumps({"needles": []}), "no needle cells at all"),
])
def test_bad_input(tmp_path, capsys, content, problem):
    path = tmp_path / "report.json"
    if content is not None:
        path.write_text(content)
    assert plot_needles.main([str(path), "--text"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and problem in err, err
