"""Trains the lightning indexers of SmolLM2-135M by DeepSeek-V3.2's dense warm-up (report, section
2.1.1; docs/model.md, "Training"): the backbone frozen, per layer the KL from the layer's attention
distribution summed over its heads (renormalized) to the indexer's softmax over slots, summed over
layers and averaged over positions; then evaluates per-layer KL and attention-mass recall on the
held-out split.

    python -m dsa_model.train_indexer --device cuda --seq-len 2048 --batch 16 --steps 2000 \\
        --max-minutes 8 --out data/models/smollm2_indexer.safetensors --log loss.json

The time budget covers the training loop (periodic evaluations included), not the setup or the
final evaluation; when it binds, the cosine schedule follows elapsed time instead of steps. The
weights are written at every periodic evaluation and once more before the final evaluation."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from .config import (CORPUS_HELDOUT_FILE, CORPUS_MANIFEST_FILE, CORPUS_TRAIN_FILE,
                     DEFAULT_MODEL_DIR, INDEXER_FILE, IndexerConfig, ModelFileError)
from .torch_model import (IndexerStack, SmolLM2Backbone, causal_upper_mask, kl_to_indexer,
                          rope_tables)

DEFAULT_DATA_RECIPE = "python_docs"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The command line (see the module docstring); raises SystemExit on a bad value."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--amp", choices=("auto", "none", "bf16"), default="auto",
                    help="backbone autocast dtype: auto = bf16 on cuda, none on cpu")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate")
    ap.add_argument("--min-lr-ratio", type=float, default=0.1,
                    help="cosine floor as a fraction of --lr")
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="global norm; 0 disables")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="training-time budget in minutes; 0 = none")
    ap.add_argument("--gguf", default=None, help="the backbone GGUF (default convert.find_gguf())")
    ap.add_argument("--train-tokens", default=os.path.join(DEFAULT_MODEL_DIR, CORPUS_TRAIN_FILE))
    ap.add_argument("--heldout-tokens",
                    default=os.path.join(DEFAULT_MODEL_DIR, CORPUS_HELDOUT_FILE))
    ap.add_argument("--data-recipe", default=None,
                    help="recorded in the weights' metadata (default: the corpus manifest's, "
                         f"else {DEFAULT_DATA_RECIPE!r})")
    ap.add_argument("--init-from", default=None, help="start from this indexer file")
    ap.add_argument("--out", default=INDEXER_FILE)
    ap.add_argument("--log", default=None, help="loss-curve JSON (default: OUT with _loss.json)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=4,
                    help="held-out windows of the periodic evaluation")
    ap.add_argument("--final-eval-windows", type=int, default=16)
    ap.add_argument("--eval-seq-len", type=int, default=None, help="default: --seq-len")
    ap.add_argument("--extra-eval-seq-len", type=int, default=0,
                    help="after the final evaluation, one more at this length (batch 1, "
                         "final-eval-windows * eval-seq-len / this windows), to show how the "
                         "indexer extrapolates beyond the trained length; 0 = none")
    ap.add_argument("--recall-k", default="256,512", help="comma-separated K of the recall")
    args = ap.parse_args(argv)
    if args.seq_len < 2 or args.batch < 1 or args.steps < 1:
        ap.error("--seq-len must be >= 2, --batch and --steps >= 1")
    if args.lr <= 0 or not 0 <= args.min_lr_ratio <= 1:
        ap.error("--lr must be > 0 and --min-lr-ratio in [0, 1]")
    try:
        args.recall_k = sorted({int(k) for k in args.recall_k.split(",") if k.strip()})
    except ValueError:
        ap.error(f"--recall-k {args.recall_k!r}: expected comma-separated integers")
    if any(k < 1 for k in args.recall_k):
        ap.error("--recall-k values must be >= 1")
    args.eval_seq_len = args.eval_seq_len or args.seq_len
    if args.log is None:
        args.log = str(Path(args.out).with_suffix("")) + "_loss.json"
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    return args


def load_tokens(path: str, min_tokens: int) -> np.ndarray:
    """A token split (`corpus`): a 1-D uint16 .npy of ids, documents separated by EOS.
    Returns it memory-mapped. Raises ModelFileError naming the file when it is missing, not 1-D
    uint16, or shorter than min_tokens."""
    if not os.path.isfile(path):
        raise ModelFileError(f"{path}: no such token file (run scripts/model_setup.sh)")
    tokens = np.load(path, mmap_mode="r")
    if tokens.dtype != np.uint16 or tokens.ndim != 1:
        raise ModelFileError(f"{path}: {tokens.dtype} {tokens.shape}, expected 1-D uint16")
    if len(tokens) < min_tokens:
        raise ModelFileError(f"{path}: {len(tokens)} tokens, fewer than one window "
                             f"of {min_tokens}")
    return tokens


def data_recipe_name(train_path: str) -> str:
    """The data recipe recorded with the weights: the corpus manifest's "recipe" (or "name") beside
    the train file, with its version when present, else DEFAULT_DATA_RECIPE."""
    manifest = Path(train_path).with_name(CORPUS_MANIFEST_FILE)
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return DEFAULT_DATA_RECIPE
    name = data.get("recipe") or data.get("name") or DEFAULT_DATA_RECIPE
    version = (data.get("stamp") or {}).get("recipe_version") or data.get("recipe_version")
    return f"{name}/{version}" if version and "/" not in str(name) else str(name)


def heldout_windows(tokens: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """count windows of seq_len tokens at evenly spaced starts over the split (deterministic):
    int64 [count, seq_len]."""
    starts = np.linspace(0, len(tokens) - seq_len, num=max(count, 1)).astype(np.int64)
    return np.stack([np.asarray(tokens[s:s + seq_len], dtype=np.int64) for s in starts])


def learning_rate(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warm-up over --warmup-steps, then cosine from --lr down to --lr * --min-lr-ratio as
    progress (in [0, 1]) goes from the warm-up's end to 1."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1.0 + math.cos(math.pi * min(1.0, progress)))


class Runner:
    """Holds the frozen backbone, the indexers and the per-length RoPE tables and masks."""

    def __init__(self, backbone: SmolLM2Backbone, indexers: IndexerStack, device: torch.device):
        self.backbone = backbone
        self.indexers = indexers
        self.device = device
        self._tables: Dict[int, tuple] = {}

    def tables(self, length: int):
        """(cos, sin, upper) of the indexer for T = length, cached."""
        if length not in self._tables:
            cfg = self.indexers.config
            cos, sin = rope_tables(length, cfg.rope_dims, cfg.rope_base, self.device)
            self._tables[length] = (cos, sin, causal_upper_mask(length, self.device))
        return self._tables[length]

    def train_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Accumulates the gradient of sum_l mean_{b,t} KL_l (one backward per layer, so one
        layer's [B, T, T] tensors live at a time). tokens: int64 [B, T]. Returns fp32 [L] per-layer
        KL (detached)."""
        cos, sin, upper = self.tables(tokens.shape[1])
        losses = []
        for target in self.backbone.iter_layers(tokens):
            scores = self.indexers.layers[target.layer](target.x, cos, sin, upper)
            kl = kl_to_indexer(target.attn_probs, scores, upper).mean()
            kl.backward()
            losses.append(kl.detach())
            del scores, kl, target
        return torch.stack(losses)

    @torch.no_grad()
    def evaluate(self, windows: np.ndarray, batch: int, recall_k: Sequence[int] = ()) -> dict:
        """Held-out metrics over windows (int64 [N, T]), per layer: KL averaged over all positions;
        for each K < T, over positions t >= K, the attention-mass recall of the indexer's top-K
        slots (sum of the layer's head-summed attention over them), of the oracle's (the
        attention's own top-K) and of the last K slots ("local"). Returns a dict of lists."""
        num_layers = self.indexers.config.num_layers
        length = windows.shape[1]
        cos, sin, upper = self.tables(length)
        kl_sum = np.zeros(num_layers)
        ks = [k for k in recall_k if k < length]
        rows: Dict[str, List[List[torch.Tensor]]] = {
            f"{kind}@{k}": [[] for _ in range(num_layers)]
            for k in ks for kind in ("indexer", "oracle", "local")}
        for b0 in range(0, len(windows), batch):
            tokens = torch.from_numpy(windows[b0:b0 + batch]).to(self.device)
            for target in self.backbone.iter_layers(tokens):
                l, p = target.layer, target.attn_probs
                scores = self.indexers.layers[l](target.x, cos, sin, upper)
                kl_sum[l] += float(kl_to_indexer(p, scores, upper).double().sum())
                for k in ks:
                    pk, zk = p[:, k:], scores[:, k:]
                    chosen = zk.topk(k, dim=-1).indices
                    rows[f"indexer@{k}"][l].append(pk.gather(-1, chosen).sum(-1).flatten().cpu())
                    rows[f"oracle@{k}"][l].append(pk.topk(k, dim=-1).values.sum(-1)
                                                  .flatten().cpu())
                    before = torch.arange(length - k, device=self.device)
                    below = pk.cumsum(-1).gather(
                        -1, before.expand(pk.shape[0], -1).unsqueeze(-1)).squeeze(-1)
                    rows[f"local@{k}"][l].append((1.0 - below).flatten().cpu())
                del scores, p, target
        positions = windows.shape[0] * length
        out = {"windows": int(windows.shape[0]), "seq_len": int(length),
               "kl_per_layer": (kl_sum / positions).tolist()}
        out["kl"] = float(np.sum(out["kl_per_layer"]))
        for name, per_layer in rows.items():
            values = [torch.cat(v).double().numpy() for v in per_layer]
            out[f"recall_{name}_mean"] = [float(v.mean()) for v in values]
            out[f"recall_{name}_p01"] = [float(np.percentile(v, 1)) for v in values]
        return out


def write_json(path: str, data: dict) -> None:
    """Writes data as JSON via a temporary file and a rename (a killed run leaves the last one)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def summary_table(final: dict, recall_k: Sequence[int]) -> str:
    """The final per-layer table: KL and, for each K, indexer / oracle / local recall means."""
    ks = [k for k in recall_k if f"recall_indexer@{k}_mean" in final]
    head = f"{'layer':>5} {'KL':>8}" + "".join(
        f" {'idx@' + str(k):>8} {'orc@' + str(k):>8} {'loc@' + str(k):>8}" for k in ks)
    lines = [head]
    n = len(final["kl_per_layer"])
    for l in range(n + 1):
        pick = (lambda v: float(np.mean(v))) if l == n else (lambda v: v[l])
        line = f"{'mean' if l == n else l:>5} {pick(final['kl_per_layer']):8.4f}"
        for k in ks:
            line += "".join(f" {pick(final[f'recall_{kind}@{k}_mean']):8.4f}"
                            for kind in ("indexer", "oracle", "local"))
        lines.append(line)
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the training and the final evaluation; returns the exit status (1 on a file error)."""
    args = parse_args(argv)
    try:
        return run(args)
    except ModelFileError as err:
        print(f"train_indexer: {err}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace) -> int:
    """The training loop of `main` (see the module docstring)."""
    from . import convert

    t_setup = time.time()
    device = torch.device(args.device)
    amp = {"auto": torch.bfloat16 if device.type == "cuda" else None, "none": None,
           "bf16": torch.bfloat16}[args.amp]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    gguf_path = Path(args.gguf) if args.gguf else convert.find_gguf()
    base_sha = convert.file_sha256(gguf_path)
    train = load_tokens(args.train_tokens, args.seq_len)
    heldout = load_tokens(args.heldout_tokens, max(args.eval_seq_len, args.extra_eval_seq_len))
    recipe = args.data_recipe or data_recipe_name(args.train_tokens)
    weights, model_config = convert.load_gguf(gguf_path)
    backbone = SmolLM2Backbone(weights, model_config, amp_dtype=amp).to(device)
    del weights
    if args.init_from:
        indexers = IndexerStack.load(args.init_from, model_config.d_model, str(device),
                                     base_model_sha256=base_sha)
    else:
        indexers = IndexerStack(IndexerConfig(num_layers=model_config.num_layers),
                                model_config.d_model).to(device)
    runner = Runner(backbone, indexers, device)
    optimizer = torch.optim.AdamW(indexers.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay)
    eval_set = heldout_windows(heldout, args.eval_seq_len, args.eval_windows)
    final_set = heldout_windows(heldout, args.eval_seq_len, args.final_eval_windows)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log = {
        "config": {**vars(args), "device_name": device_name,
                   "torch": torch.__version__, "base_model_sha256": base_sha,
                   "gguf": str(gguf_path), "data_recipe": recipe,
                   "train_split_tokens": int(len(train)),
                   "heldout_split_tokens": int(len(heldout)),
                   "indexer_parameters": int(sum(p.numel() for p in indexers.parameters())),
                   "loss": "sum over layers of the KL averaged over positions"},
        "train": [], "heldout": [], "final": None, "result": None,
    }
    budget_s = args.max_minutes * 60.0
    tokens_per_step = args.batch * args.seq_len
    step = 0
    stopped_by = "steps"

    def settings() -> dict:
        return {"seed": args.seed, "steps": step, "tokens_seen": step * tokens_per_step,
                "seq_len": args.seq_len, "batch_size": args.batch, "lr": args.lr,
                "min_lr_ratio": args.min_lr_ratio, "warmup_steps": args.warmup_steps,
                "weight_decay": args.weight_decay, "optimizer": "AdamW(0.9, 0.95)",
                "loss": "dense warm-up KL (DeepSeek-V3.2 2.1.1), head-summed target",
                "data_recipe": recipe, "train_file": Path(args.train_tokens).name,
                "device": device_name, "init_from": Path(args.init_from).name
                if args.init_from else "random", "trainer": "dsa_model.train_indexer"}

    def periodic_eval(elapsed: float) -> None:
        e = runner.evaluate(eval_set, args.batch)
        log["heldout"].append({"step": step, "tokens": step * tokens_per_step, "kl": e["kl"],
                               "kl_mean_layer": e["kl"] / len(e["kl_per_layer"]),
                               "elapsed_s": round(elapsed, 2)})
        print(f"step {step:6d}  held-out KL {e['kl']:.4f} "
              f"(per layer {e['kl'] / len(e['kl_per_layer']):.4f})  "
              f"{elapsed:7.1f} s", flush=True)
        write_json(args.log, log)

    print(f"setup {time.time() - t_setup:.1f} s: {device_name}, backbone amp {amp}, "
          f"train {len(train)} tokens, held-out {len(heldout)}, {tokens_per_step} tokens a step",
          flush=True)
    t0 = time.time()
    periodic_eval(0.0)
    while step < args.steps:
        elapsed = time.time() - t0
        if budget_s and elapsed >= budget_s:
            stopped_by = "time"
            break
        progress = max((step - args.warmup_steps) / max(1, args.steps - args.warmup_steps),
                       elapsed / budget_s if budget_s else 0.0)
        lr = learning_rate(step, progress, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, len(train) - args.seq_len + 1, size=args.batch)
        batch = torch.from_numpy(np.stack([np.asarray(train[s:s + args.seq_len], np.int64)
                                           for s in starts])).to(device)
        optimizer.zero_grad(set_to_none=True)
        per_layer = runner.train_step(batch)
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(indexers.parameters(), args.grad_clip)
        optimizer.step()
        step += 1
        loss = float(per_layer.sum())
        if not math.isfinite(loss):
            print(f"step {step}: loss {loss}, stopping", file=sys.stderr)
            stopped_by = "non-finite loss"
            break
        elapsed = time.time() - t0
        log["train"].append({"step": step, "tokens": step * tokens_per_step,
                             "loss": round(loss, 6), "lr": lr, "elapsed_s": round(elapsed, 3)})
        if step % args.log_every == 0 or step == 1:
            print(f"step {step:6d}  loss {loss:.4f}  lr {lr:.2e}  "
                  f"{step * tokens_per_step / elapsed:9.0f} tok/s", flush=True)
        if step % args.eval_every == 0:
            periodic_eval(time.time() - t0)
            indexers.save(args.out, base_sha, settings())
    train_s = time.time() - t0
    if log["heldout"][-1]["step"] != step:
        periodic_eval(time.time() - t0)
    if stopped_by == "non-finite loss":
        write_json(args.log, log)
        return 1
    indexers.save(args.out, base_sha, settings())
    log["result"] = {"steps": step, "tokens_seen": step * tokens_per_step,
                     "train_seconds": round(train_s, 1), "stopped_by": stopped_by,
                     "out": args.out}
    write_json(args.log, log)
    print(f"trained {step} steps, {step * tokens_per_step} tokens in {train_s:.1f} s "
          f"(stopped by {stopped_by}); wrote {args.out}", flush=True)

    t_eval = time.time()
    final = runner.evaluate(final_set, args.batch, args.recall_k)
    final["eval_seconds"] = round(time.time() - t_eval, 1)
    log["final"] = final
    write_json(args.log, log)
    first, last = log["heldout"][0]["kl"], log["heldout"][-1]["kl"]
    print(f"held-out KL (sum over layers): periodic set ({args.eval_windows} windows) "
          f"{first:.4f} at step 0 -> {last:.4f} at step {step}; final set "
          f"({final['windows']} windows x {final['seq_len']} tokens) {final['kl']:.4f}; "
          f"eval {final['eval_seconds']} s")
    print(summary_table(final, args.recall_k))
    if args.extra_eval_seq_len:
        t_eval = time.time()
        count = max(1, args.final_eval_windows * args.eval_seq_len // args.extra_eval_seq_len)
        extra = runner.evaluate(heldout_windows(heldout, args.extra_eval_seq_len, count), 1,
                                args.recall_k)
        extra["eval_seconds"] = round(time.time() - t_eval, 1)
        log["final_extra"] = extra
        write_json(args.log, log)
        print(f"extra held-out evaluation: {count} windows x {args.extra_eval_seq_len} tokens, "
              f"KL {extra['kl']:.4f}; eval {extra['eval_seconds']} s")
        print(summary_table(extra, args.recall_k).splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
