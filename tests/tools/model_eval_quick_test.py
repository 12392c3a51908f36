"""`dsa eval --model smollm2 --quick` end to end (tools/dsa/model_eval.h): the real model on two
1K windows of held-out text under 5 arms (one with d = 3 speculative steps) and the 1K pass-key
cases. Checks what must hold whatever the machine:
- every perplexity finite and above 1;
- DSA all-keep's perplexity within [-0.5%, +2%] of dense's (the target is 2%; a few tokens may
  score better sparse by chance);
- the sparse arms' attention-mass recall in (0, 1], measured at every layer;
- SPIN's realized sparsity and audited miss rate present and in range;
- the speculative arm scoring every token, with an accepted count in [0, d];
- dense retrieving at least one pass key, and all-keep every key dense retrieves (the target:
  equal to dense where dense succeeds).
$DSA_MODEL_DIR, when set, names the model folder (else dsa's defaults).

usage: model_eval_quick_test.py --dsa build/bin/dsa [--work-dir DIR]
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dsa", required=True, help="the dsa binary")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    work = args.work_dir or tempfile.mkdtemp(prefix="model_eval_quick_")
    os.makedirs(work, exist_ok=True)
    out = os.path.join(work, "quick.json")
    command = [args.dsa, "eval", "--model", "smollm2", "--quick", "--json", out]
    model_dir = os.environ.get("DSA_MODEL_DIR")
    if model_dir:
        command += ["--model-file", os.path.join(model_dir, "model.safetensors"),
                    "--heldout-tokens", os.path.join(model_dir, "python_docs_heldout.npy"),
                    "--needles", os.path.join(model_dir, "needles.json")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    sys.stderr.write(run.stderr)
    sys.stdout.write(run.stdout)
    if run.returncode != 0:
        print(f"FAIL: dsa eval exited {run.returncode} (missing model files? run "
              "scripts/model_setup.sh)")
        return 1
    report = json.load(open(out))
    failures = []
    if report.get("complete") is not True:
        failures.append("the report is not marked complete")
    if os.path.exists(out + ".partial"):
        failures.append(f"{out}.partial left behind")
    cells = {c["arm"]: c for c in report["perplexity"]}
    spec_arm = "spec d=3 spin rho=0.4 union + prefix-valid"
    for arm in ("dense", "all-keep", "spin rho=0.4 gamma=0.05", "mli k=1 r=1/2", spec_arm):
        if arm not in cells:
            failures.append(f"no perplexity cell for {arm}")
    for c in report["perplexity"]:
        for key in ("real_perplexity", "greedy_perplexity"):
            if not (math.isfinite(c[key]) and c[key] > 1.0):
                failures.append(f"{c['arm']}: {key} {c[key]} is not a finite perplexity > 1")
    if not failures:
        # Sparse attention may score a few tokens better than dense by chance; 0.5% below dense
        # is noise, more is a wrong reference.
        dense, keep = cells["dense"]["real_perplexity"], cells["all-keep"]["real_perplexity"]
        if not dense * 0.995 <= keep <= dense * 1.02:
            failures.append(f"all-keep perplexity {keep:.4f} not in [dense {dense:.4f} -0.5%, +2%]")
        for arm in ("all-keep", "spin rho=0.4 gamma=0.05", spec_arm):
            mass = cells[arm]
            if not 0.0 < mass["p1_mass_recall"] <= mass["mean_mass_recall"] <= 1.0 + 1e-9:
                failures.append(f"{arm}: attention-mass recall out of range: {mass}")
            if len(mass["layers"]) != 30 or any(l["rows"] == 0 for l in mass["layers"]):
                failures.append(f"{arm}: not every layer's rows were measured")
        spin = cells["spin rho=0.4 gamma=0.05"]
        if not (0.0 < spin["realized_block_sparsity"] < 1.0 and spin["audited_rows"] > 0 and
                0.0 <= spin["mean_miss_rate"] <= spin["p99_miss_rate"] <= 1.0):
            failures.append(f"SPIN's selection statistics out of range: {spin}")
        if cells["all-keep"]["realized_block_sparsity"] != 0.0:
            failures.append("all-keep scored fewer blocks than it sees")
        spec = cells[spec_arm]
        # Every window is scored whole whatever the drafts: 2 windows x 32 tokens.
        if spec["tokens_scored"] != cells["dense"]["tokens_scored"]:
            failures.append(f"speculative steps scored {spec['tokens_scored']} tokens, dense "
                            f"{cells['dense']['tokens_scored']}")
        if not (spec["steps"] > 0 and 0.0 <= spec["mean_accepted"] <= 3.0):
            failures.append(f"speculative steps out of range: {spec}")
    found = {}
    for n in report["needles"]:
        found.setdefault(n["arm"], {})[n["depth"]] = n["found"]
    # The speculative arm answers no pass keys (one row a step would repeat its base arm).
    if len(report["needles"]) != 20:
        failures.append(f"{len(report['needles'])} needle cells, expected 4 arms x 5 depths")
    dense_found = [d for d, ok in found.get("dense", {}).items() if ok]
    if not dense_found:
        failures.append("dense retrieved no pass key at 1K")
    missed = [d for d in dense_found if not found.get("all-keep", {}).get(d, False)]
    if missed:
        failures.append(f"all-keep missed pass keys dense found, at depths {missed}")
    for f in failures:
        print("FAIL:", f)
    if not failures:
        print(f"OK: dense {cells['dense']['real_perplexity']:.4f}, all-keep "
              f"{cells['all-keep']['real_perplexity']:.4f}; dense found depths {dense_found}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
