#!/usr/bin/env python3
"""Tests of bench/peers/report.py (the top-K and scan reports against the public peers) on the
committed H100 results and on small made-up ones: the committed reports are what report.py makes
of their JSONs today, each peer gets its own table with ratios to ours timed in its own process,
and what did not run or was refused says so. Standard library only."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
REPORT = os.path.join(ROOT, "bench", "peers", "report.py")
RESULTS = os.path.join(ROOT, "docs", "results")


def run_report(args, markdown):
    subprocess.run([sys.executable, REPORT, *args, "--markdown", markdown], check=True,
                   env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    with open(markdown, encoding="utf-8") as f:
        return f.read()


def result(shape, method, us, same_process=None):
    rows = int(shape.split("x")[0])
    r = {"shape": shape, "rows": rows, "slots": int(shape.split("x")[1]), "method": method,
         "us": us, "rows_same_set": rows, "rows_top_k": rows}
    if same_process is not None:
        r["dsa_us_same_process"] = same_process
    return r


def section(text, heading):
    """The lines of the table under `heading` (a '### ' line), up to the next blank line."""
    lines = text.splitlines()
    start = lines.index(heading) + 2
    end = lines.index("", start) if "" in lines[start:] else len(lines)
    return lines[start:end]


class PeersReportTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def report(self, main=None, extra=None):
        """report.py's markdown for a made-up bench_topk_peers JSON and/or extra JSON."""
        args = []
        for name, data, flag in (("main.json", main, []), ("extra.json", extra, ["--extra"])):
            if data is not None:
                with open(self.path(name), "w", encoding="utf-8") as f:
                    json.dump(data, f)
                args += flag + [self.path(name)]
        return run_report(args + ["--commit", "x"], self.path("out.md"))

    def test_the_committed_reports_are_what_report_py_makes_of_their_json(self):
        cases = [
            ("topk_peers_h100.md", ["topk_peers_h100_bell.json", "topk_peers_h100_equal.json"],
             [], "3252395"),
            ("topk_frameworks_h100.md", [],
             ["topk_frameworks_h100_bell.json", "topk_frameworks_h100_equal.json"], "5b94986"),
        ]
        for markdown, reports, extras, commit in cases:
            with self.subTest(markdown=markdown):
                args = [os.path.join(RESULTS, r) for r in reports]
                for extra in extras:
                    args += ["--extra", os.path.join(RESULTS, extra)]
                made = run_report(args + ["--commit", commit], self.path(markdown))
                with open(os.path.join(RESULTS, markdown), encoding="utf-8") as f:
                    self.assertEqual(made, f.read())

    def test_each_peer_gets_a_table_with_ratios_to_ours_in_its_own_process(self):
        extra = {
            "device": "GPU", "k": 2048, "scores": "bell", "source": "bench/peers/fw_bench.py",
            "peers": {"sgl": {"origin": "a"}, "sglang": {"origin": "b"}},
            "methods": {"dsa": "ours", "sgl_fast": "sgl's", "sglang_v2": "SGLang's"},
            "results": [
                result("1x16384", "dsa", 20.0),
                result("1x16384", "sgl_fast", 30.0, same_process=15.0),
                result("1x16384", "sglang_v2", 10.0, same_process=25.0),
                result("8x16384", "dsa", 22.0),
                result("8x16384", "sgl_fast", None),
            ],
        }
        text = self.report(extra=extra)
        self.assertIn("# Top-K against sgl and sglang, in the same run", text)
        sgl = section(text, "### sgl (`fw_bench`)")
        self.assertEqual(sgl[0], "| rows x slots | dsa, same process (us) | sgl_fast (us) | "
                                 "sgl_fast / dsa | sgl_fast checks |")
        self.assertEqual(sgl[2], "| 1 x 16384 | 15.0 | 30.0 | 2.00x | same set, top-K |")
        self.assertEqual(sgl[3], "| 8 x 16384 | 22.0 | refused |  |  |")
        sglang = section(text, "### sglang (`fw_bench`)")
        # sglang_v2 is SGLang's, not sgl's, though "sgl" prefixes it; 8 x 16K it never ran.
        self.assertEqual(sglang[2:], ["| 1 x 16384 | 25.0 | 10.0 | 0.40x | same set, top-K |"])

    def test_an_extra_without_its_own_dsa_row_takes_ours_from_bench_topk_peers(self):
        main = {"device": "GPU", "k": 2048, "scores": "bell",
                "results": [result("1x65536", "dsa", 19.0), result("1x65536", "fi_exact", 38.0)]}
        extra = {"device": "GPU", "k": 2048, "scores": "bell", "deepselect": "v1",
                 "source": "bench/peers/deepselect_bench.py",
                 "methods": {"ds_fp32": "DeepSelect fp32"},
                 "results": [result("1x65536", "ds_fp32", 57.0)]}
        text = self.report(main, extra)
        flashinfer = section(text, "### FlashInfer 0.7.4 (`bench_topk_peers`)")
        self.assertEqual(flashinfer[2], "| 1 x 65536 | 19.0 | 38.0 | 2.00x | same set, top-K | "
                                        "refused |  |  | refused |  |  |")
        deepselect = section(text, "### DeepSelect (`deepselect_bench`)")
        self.assertEqual(deepselect[2], "| 1 x 65536 | 19.0 (other process) | 57.0 | 3.00x | "
                                        "same set, top-K |")

    def test_ours_refused_in_the_harness_gives_no_ratio_and_each_base_is_shown(self):
        main = {"device": "H100", "k": 2048, "scores": "bell",
                "results": [result("1x16384", "dsa", 10.0), result("8x16384", "dsa", 10.0)]}
        extra = {
            "device": "H200", "k": 2048, "scores": "bell", "source": "bench/peers/fw_bench.py",
            "peers": {"vllm": {"origin": "a"}, "vllm_v1": {"origin": "b"}},
            "methods": {"dsa": "ours", "vllm_a": "a", "vllm_b": "b", "vllm_v1_c": "c"},
            "results": [
                result("1x16384", "dsa", None),
                result("1x16384", "vllm_a", 30.0),
                result("8x16384", "dsa", 20.0),
                result("8x16384", "vllm_a", 30.0, same_process=15.0),
                result("8x16384", "vllm_b", 30.0, same_process=10.0),
                result("8x16384", "vllm_v1_c", 40.0),
            ],
        }
        text = self.report(main, extra)
        vllm = section(text, "### vllm (`fw_bench`)")
        # Ours refused in the harness's process: no ratio against another process's (device's).
        self.assertEqual(vllm[2], "| 1 x 16384 | refused | 30.0 |  | same set, top-K | not run "
                                  "|  |  |")
        self.assertEqual(vllm[3], "| 8 x 16384 | 15.0 / 10.0 | 30.0 | 2.00x | same set, top-K | "
                                  "30.0 | 3.00x | same set, top-K |")
        # The longest peer name that prefixes a method is its peer.
        self.assertEqual(section(text, "### vllm_v1 (`fw_bench`)")[2:],
                         ["| 8 x 16384 | 20.0 | 40.0 | 2.00x | same set, top-K |"])

    def test_every_base_a_ratio_used_is_shown_and_none_is_borrowed_across_devices(self):
        def run(main_device):
            main = {"device": main_device, "k": 2048, "scores": "bell",
                    "results": [result("1x16384", "dsa", 10.0)]}
            extra = {
                "device": "H200", "k": 2048, "scores": "bell",
                "source": "bench/peers/fw_bench.py", "peers": {"vllm": {"origin": "a"}},
                "methods": {"vllm_a": "a", "vllm_b": "b", "vllm_c": "c"},
                "results": [
                    result("1x16384", "vllm_a", 30.0, same_process=15.0),
                    result("1x16384", "vllm_b", 40.0),
                    # Refused: its process's time of ours is no base of any ratio.
                    result("1x16384", "vllm_c", None, same_process=12.0),
                ],
            }
            text = self.report(main, extra)
            return section(text, "### vllm (`fw_bench`)")[2]

        self.assertEqual(run("H200"), "| 1 x 16384 | 15.0 / 10.0 (other process) | 30.0 | 2.00x "
                                      "| same set, top-K | 40.0 | 4.00x | same set, top-K | "
                                      "refused |  |  |")
        self.assertEqual(run("H100"), "| 1 x 16384 | 15.0 | 30.0 | 2.00x | same set, top-K | "
                                      "40.0 |  | same set, top-K | refused |  |  |")

    def test_an_extra_that_ran_nothing_is_still_named_in_the_title(self):
        extra = {"device": "H200", "k": 2048, "scores": "bell",
                 "source": "bench/peers/deepselect_bench.py", "results": []}
        text = self.report(extra=extra)
        self.assertTrue(text.startswith("# Top-K against deepselect_bench, in the same run"))


if __name__ == "__main__":
    unittest.main()
