"""Checks the C++ forward pass (dsa-model-forward, attention_worker/llama_model.h) against the numpy
reference (dsa_model/reference.py) on a real prompt from the held-out split: logits at every
position, dense and sparse, and the lightning indexer's q / w / k; every C++ sparse selection must
be a valid top-K by the reference's own index scores.

Runs the binary three times on the same prompt (default 2,048 tokens of python_docs_heldout.npy):
  dense:        one pass, dense causal attention;
  dense_decode: a prefill pass of n - 16 rows, then one row per pass (the decode path);
  sparse:       one pass, K = 64 (so it differs from dense past position 63), MLI lag depth 1,
                retention 1/2: every full layer f scores slots 0..t per row (fp32) and takes the
                top K; layer l attends sigma(l)'s selection (DESIGN.md 4.3).
The reference runs dense once (for both dense runs) and sparse with the selections the C++ tool
wrote.

Tolerances (fp32 on both sides, different summation orders; the measured figures are printed):
  dense logits (one pass and decode): max |C++ - reference| <= 1e-3 over every position and
            vocabulary entry (logits of scale ~15-40), and per position <= 2e-5 x that position's
            max |logit| (measured at 2,048 tokens: 9.9e-5 and 3.3e-6, both runs);
  sparse logits: <= 2e-2 and 1e-3 x scale (measured: 2.0e-3 and 7.3e-5 with the random indexer:
            the sparse model is off its training distribution and amplifies fp32 rounding; there
            the fp32 reference itself is 2.2e-3 from a float64 one and the C++ 3.6e-3, see --fp64);
  indexer:  max |C++ - reference| of q, w, k <= 1e-4 x the tensor's max |value| (measured: 2.1e-6
            dense, 3.4e-5 sparse);
  top-K:    per row, the selection has min(K, t + 1) distinct slots in [0, t] (then -1), and its
            worst selected score >= the best unselected score - 1e-4 x (1 + max |score| of the
            row) by the reference's scores (measured: 8e-7); rows where the two top-Ks differ are
            counted (11 of 30,720: near ties).
Without the trained indexer (data/models/smollm2_indexer.safetensors) the check writes seeded
random indexer weights (reference.random_indexer_weights) into --work-dir.

Exit status 0 when every check passes, 1 otherwise (2 when the model files are missing: run
scripts/model_setup.sh). Usage:
  .venv-model/bin/python python/dsa_model/tests/check_forward.py --bin build/bin/dsa-model-forward
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PYTHON_DIR = Path(__file__).resolve().parents[2]
REPO_DIR = PYTHON_DIR.parent
sys.path.insert(0, str(PYTHON_DIR))

from dsa_model.config import (CORPUS_HELDOUT_FILE, DEFAULT_MODEL_DIR, INDEXER_FILE,  # noqa: E402
                              MODEL_FILE, IndexerConfig)

# (max abs diff, max diff / the position's max |logit|) per mode.
LOGITS_TOL = {"dense": (1e-3, 2e-5), "dense_decode": (1e-3, 2e-5), "sparse": (2e-2, 1e-3)}
INDEXER_REL_TOL = 1e-4
SCORE_REL_TOL = 1e-4


def read_safetensors(path: Path):
    """(tensors name -> fp32 array, metadata) of a safetensors file of F32 tensors."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    metadata = header.pop("__metadata__", {})
    out = {}
    for name, entry in header.items():
        if entry["dtype"] != "F32":
            raise ValueError(f"{path}: {name} is {entry['dtype']}, expected F32")
        begin, end = entry["data_offsets"]
        out[name] = np.frombuffer(data[begin:end], dtype="<f4").reshape(entry["shape"])
    return out, metadata


def attended_layers(num_layers: int, full_layers, lag_depth: int):
    """sigma(l) of DESIGN.md 4.3 for every layer (common/mli_schedule.h's rule)."""
    out = []
    for layer in range(num_layers):
        nearest = max(f for f in full_layers if f <= layer)
        rank = full_layers.index(nearest)
        out.append(full_layers[rank - lag_depth] if rank >= lag_depth else nearest)
    return out


def run_tool(args, mode: str, tag: str, work: Path, extra):
    """Runs dsa-model-forward; its outputs are work/{tag}_*; returns its timing report."""
    cmd = [str(args.bin), "--model", str(args.model_dir / MODEL_FILE), "--indexer",
           str(args.indexer), "--tokens", str(args.model_dir / CORPUS_HELDOUT_FILE), "--offset",
           str(args.offset), "--num-tokens", str(args.num_tokens), "--mode", mode,
           "--top-k", str(args.top_k), "--lag-depth", str(args.lag_depth), "--retention",
           str(args.retention), "--out-logits", str(work / f"{tag}_logits.npy"),
           "--out-indexer", str(work / f"{tag}_indexer.safetensors"),
           "--report", str(work / f"{tag}_report.json")] + extra
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((work / f"{tag}_report.json").read_text())


def compare_logits(name: str, cpp: np.ndarray, ref: np.ndarray, failures: list) -> dict:
    diff = np.abs(cpp.astype(np.float64) - ref.astype(np.float64))
    per_position = diff.max(axis=1)
    scale = np.abs(ref).max(axis=1).astype(np.float64)
    rel = per_position / scale
    out = {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
           "max_rel_to_scale": float(rel.max()), "logit_scale_max": float(scale.max()),
           "logit_scale_min": float(scale.min()),
           "argmax_agreement": float((cpp.argmax(1) == ref.argmax(1)).mean()),
           "worst_position": int(per_position.argmax())}
    abs_tol, rel_tol = LOGITS_TOL[name]
    if out["max_abs_diff"] > abs_tol:
        failures.append(f"{name} logits: max abs diff {out['max_abs_diff']:.3g} > {abs_tol}")
    if out["max_rel_to_scale"] > rel_tol:
        failures.append(f"{name} logits: max diff / scale {out['max_rel_to_scale']:.3g} > "
                        f"{rel_tol}")
    return out


def compare_indexer(name: str, dump: dict, ref, inputs: dict, failures: list) -> dict:
    out = {}
    for key, cpp in dump.items():
        _, layer, what = key.split(".")
        layer = int(layer)
        q, w, k = ref.indexer(layer, inputs[layer])
        expected = {"q": q, "w": w, "k": k}[what]
        diff = float(np.abs(cpp - expected).max())
        scale = float(np.abs(expected).max())
        out[key] = {"max_abs_diff": diff, "scale": scale, "rel": diff / scale}
        if diff > INDEXER_REL_TOL * scale:
            failures.append(f"{name} indexer {key}: max diff {diff:.3g} > {INDEXER_REL_TOL} x "
                            f"{scale:.3g}")
    return out


def check_selections(ref, selections: np.ndarray, full_layers, inputs: dict, k: int,
                     failures: list) -> dict:
    """Every C++ selection is a valid top-K of the reference's own index scores."""
    n = selections.shape[1]
    rows_differing, worst_margin = 0, 0.0
    for fi, layer in enumerate(full_layers):
        q, w, keys = ref.indexer(layer, inputs[layer])
        scores = ref.index_scores(layer, q, w, keys).astype(np.float64)  # [n, n], -inf above t
        for t in range(n):
            sel = selections[fi, t]
            count = min(k, t + 1)
            chosen = sel[:count]
            if (sel[count:] != -1).any() or (chosen < 0).any() or (chosen > t).any() \
                    or len(set(chosen.tolist())) != count:
                failures.append(f"layer {layer} row {t}: malformed selection {sel.tolist()}")
                continue
            row = scores[t, :t + 1]
            mask = np.zeros(t + 1, dtype=bool)
            mask[chosen] = True
            if count == t + 1:
                continue
            tol = SCORE_REL_TOL * (1.0 + np.abs(row).max())
            margin = row[~mask].max() - row[mask].min()  # > 0: a better slot was left out
            worst_margin = max(worst_margin, margin / (1.0 + np.abs(row).max()))
            if margin > tol:
                failures.append(f"layer {layer} row {t}: selected score {row[mask].min():.6g} < "
                                f"unselected {row[~mask].max():.6g} - {tol:.3g}")
            order = np.lexsort((np.arange(t + 1), -row))[:count]
            if not np.array_equal(np.sort(order), np.sort(chosen)):
                rows_differing += 1
    return {"rows_checked": int(len(full_layers) * n), "rows_not_equal_reference_topk":
            rows_differing, "worst_margin_rel": float(worst_margin)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin", type=Path, required=True, help="dsa-model-forward")
    parser.add_argument("--model-dir", type=Path,
                        default=Path(os.environ.get("DSA_MODEL_DIR", REPO_DIR / DEFAULT_MODEL_DIR)))
    parser.add_argument("--indexer", type=Path, default=None,
                        help=f"indexer file (default {INDEXER_FILE} if present, else random)")
    parser.add_argument("--work-dir", type=Path, default=REPO_DIR / "build/check_forward")
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--num-tokens", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--lag-depth", type=int, default=1)
    parser.add_argument("--retention", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=16,
                        help="rows run one per pass at the end of the dense decode run (0: none)")
    parser.add_argument("--fp64", action="store_true",
                        help="also run the sparse reference in float64 and report both sides' "
                             "distance to it (slow)")
    parser.add_argument("--report", type=Path, default=None,
                        help="the figures as JSON (default: WORK_DIR/summary.json)")
    args = parser.parse_args()
    if not args.model_dir.is_absolute():
        args.model_dir = REPO_DIR / args.model_dir
    for needed in (args.model_dir / MODEL_FILE, args.model_dir / CORPUS_HELDOUT_FILE):
        if not needed.is_file():
            print(f"check_forward: FAIL: {needed} is missing: run scripts/model_setup.sh first "
                  "(it converts the model and tokenizes the held-out split)", file=sys.stderr)
            return 2
    if not args.bin.is_file():
        print(f"check_forward: FAIL: no binary {args.bin}", file=sys.stderr)
        return 2
    from dsa_model.convert import read_safetensors_header
    from dsa_model.reference import Reference, random_indexer_weights, write_indexer_weights

    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    _, model_meta = read_safetensors_header(args.model_dir / MODEL_FILE)
    indexer_kind = "given"
    if args.indexer is None:
        trained = REPO_DIR / INDEXER_FILE
        if trained.is_file():
            args.indexer, indexer_kind = trained, "trained"
        else:
            args.indexer, indexer_kind = work / "random_indexer.safetensors", "random (seed 0)"
            write_indexer_weights(random_indexer_weights(0), IndexerConfig(), args.indexer,
                                  model_meta.get("source_sha256", ""))

    tokens = np.load(args.model_dir / CORPUS_HELDOUT_FILE)[
        args.offset:args.offset + args.num_tokens].astype(np.int64)
    if len(tokens) != args.num_tokens:
        print(f"check_forward: FAIL: the held-out split has only {len(tokens)} tokens from "
              f"offset {args.offset}", file=sys.stderr)
        return 2
    failures: list = []
    summary = {"tokens": int(len(tokens)), "offset": args.offset, "top_k": args.top_k,
               "lag_depth": args.lag_depth, "retention": args.retention,
               "indexer": f"{args.indexer} ({indexer_kind})",
               "tolerances": {"logits_abs_and_rel_to_scale": LOGITS_TOL,
                              "indexer_rel": INDEXER_REL_TOL, "score_rel": SCORE_REL_TOL}}

    summary["cpp_dense"] = run_tool(args, "dense", "dense", work, [])
    sparse_report = run_tool(args, "sparse", "sparse", work,
                             ["--out-selections", str(work / "sparse_selections.npy")])
    summary["cpp_sparse"] = sparse_report
    if args.decode_steps > 0:
        summary["cpp_dense_decode"] = run_tool(
            args, "dense", "dense_decode", work,
            ["--decode-from", str(args.num_tokens - args.decode_steps)])
    full_layers = sparse_report["full_layers"]
    dump_layers = sorted({int(key.split(".")[1]) for key in
                          read_safetensors(work / "dense_indexer.safetensors")[0]})

    ref = Reference.from_dir(args.model_dir, args.indexer)
    emb = ref.weights["token_embd.weight"]

    def forward_capturing(selections, layers):
        """Reference logits and the layer inputs x_l of `layers`, in one forward."""
        inputs = {}

        def visit(layer, x):
            if layer in layers:
                inputs[layer] = x.copy()

        h = ref._layers(ref._tokens(tokens), selections, visit)
        return (h @ emb.T).astype(np.float32), inputs

    start = time.time()
    ref_dense, dense_inputs = forward_capturing(None, set(dump_layers))
    summary["reference_dense_seconds"] = time.time() - start
    cpp_dense = np.load(work / "dense_logits.npy")
    summary["dense"] = compare_logits("dense", cpp_dense, ref_dense, failures)
    if args.decode_steps > 0:
        summary["dense_decode"] = compare_logits(
            "dense_decode", np.load(work / "dense_decode_logits.npy"), ref_dense, failures)
    summary["dense_indexer"] = compare_indexer(
        "dense", read_safetensors(work / "dense_indexer.safetensors")[0], ref, dense_inputs,
        failures)
    del ref_dense

    selections = np.load(work / "sparse_selections.npy")
    sigma = attended_layers(ref.config.num_layers, full_layers, args.lag_depth)
    per_layer = [selections[full_layers.index(sigma[layer])] for layer in
                 range(ref.config.num_layers)]
    start = time.time()
    ref_sparse, sparse_inputs = forward_capturing(per_layer, set(full_layers) | set(dump_layers))
    summary["reference_sparse_seconds"] = time.time() - start
    cpp_sparse = np.load(work / "sparse_logits.npy")
    summary["sparse"] = compare_logits("sparse", cpp_sparse, ref_sparse, failures)
    summary["sparse_vs_dense_max_abs"] = float(np.abs(cpp_sparse - cpp_dense).max())
    if summary["sparse_vs_dense_max_abs"] < 1e-2:
        failures.append("sparse logits equal dense ones: K does not restrict attention")
    summary["sparse_indexer"] = compare_indexer(
        "sparse", read_safetensors(work / "sparse_indexer.safetensors")[0], ref, sparse_inputs,
        failures)
    if args.fp64:
        ref64 = Reference(ref.weights, ref.config, dtype=np.float64)
        logits64 = ref64.forward(tokens, per_layer).astype(np.float64)
        summary["sparse_fp64"] = {
            "cpp_max_abs_diff": float(np.abs(cpp_sparse - logits64).max()),
            "reference_fp32_max_abs_diff": float(np.abs(ref_sparse - logits64).max())}
        del ref64, logits64
    summary["selections"] = check_selections(ref, selections, full_layers, sparse_inputs,
                                             args.top_k, failures)
    summary["failures"] = failures[:20]
    summary["num_failures"] = len(failures)
    text = json.dumps(summary, indent=2)
    print(text)
    (args.report or work / "summary.json").write_text(text + "\n")
    if failures:
        print(f"check_forward: FAIL ({len(failures)} checks), first: {failures[0]}",
              file=sys.stderr)
        return 1
    print("check_forward: PASS", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
