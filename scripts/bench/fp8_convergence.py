"""FP8 against bf16 on real text: the Python standard library's source, byte-level tokens.

    python scripts/bench/fp8_convergence.py [--iters 600] [--seeds 1234 1235 1236] [--runs ...] [--out DIR]
        [--shape proxy|llama8b] [--gpus N]

Every machine has this corpus: the ``*.py`` files of the running interpreter's standard library
(its packages and tests included, site-packages left out: about 31 MB on CPython 3.11), one
document per file, tokenized with ``bridge preprocess-data --tokenizer-type ByteLevelTokenizer``
(98% train, 2% validation). The same small Llama-style model (8 layers, hidden 1024, SwiGLU FFN
4096, GQA 16/4, seq 1024, global batch 32, compiled layers) trains ``--iters`` iterations in bf16
and with each FP8 preset, once per seed (``rng.seed``), each seed's runs on the same batches. Each
run ends with one validation pass over the same 8 held-out batches (262K tokens). ``--shape llama8b`` trains
4 layers of Llama-3-8B's shape instead (hidden 4096, SwiGLU FFN 14336, GQA 32/8; the ``llama8b`` recipe's layout,
torch FSDP2 over the GPUs, at seq 1024 and the same global batch), ``--gpus N`` under torchrun on N GPUs (one
micro-batch of 32 / N rows each): FP8 at the shapes where it is 1.2x bf16, the same bar.

Two bf16 runs of one command already land apart (their kernels add in no fixed order, and at this
learning rate the difference grows), so one run per precision cannot tell a 1% difference: the
comparison is between the means over seeds, next to bf16's own spread. Results accumulate in
DIR/fp8_convergence.json (a later call with other seeds or runs adds to them); the table covers all
of them. The training curves go to DIR/fp8_convergence.csv and, where matplotlib imports, a plot,
DIR/fp8_convergence.png (``--shape llama8b``: fp8_convergence_llama8b.json, .csv and .png).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from gpu_timing import require_cuda  # this folder's helper

RUNS = {"bf16": ["mixed_precision=bf16_mixed"],
        "fp8 tensorwise": ["mixed_precision=bf16_with_fp8_current_scaling_mixed"],
        "fp8 rowwise": ["mixed_precision=bf16_with_fp8_rowwise_mixed"]}
"""Each run's overrides; every run compiles its layers (as the FP8 presets do) and compares with "bf16"."""
ITERATION = re.compile(r"^iteration\s+(\d+)/\d+ \| .*?elapsed ms/iter ([0-9.]+) .*?lm loss ([0-9.]+) ", re.MULTILINE)
VALIDATION = re.compile(r"^validation at the end of training \(iteration \d+\) \| lm loss ([0-9.]+)", re.MULTILINE)
MODEL = ["recipe=llama1b", "model.num_layers=8", "model.hidden_size=1024", "model.ffn_hidden_size=4096",
         "model.num_attention_heads=16", "model.num_query_groups=4", "model.seq_length=1024",
         "model.share_embeddings_and_output_weights=true", "tokenizer=byte_level", "dataset=gpt",
         "dataset.split='98,2,0'", "train.micro_batch_size=16", "train.global_batch_size=32", "train.eval_iters=8",
         "model.compile_layers=true", "optimizer.lr=4e-4", "optimizer.min_lr=4e-5", "scheduler.lr_warmup_iters=100",
         "logger.log_interval=1"]
LLAMA8B_LAYERS = ["recipe=llama8b", "model.num_layers=4", "model.seq_length=1024", "tokenizer=byte_level",
                  "dataset=gpt", "dataset.split='98,2,0'", "train.global_batch_size=32", "train.eval_iters=8",
                  "optimizer.lr=3e-4", "optimizer.min_lr=3e-5", "scheduler.lr_warmup_iters=100",
                  "logger.log_interval=1", "model.first_last_layers_bf16=false"]
"""llama8b's layers, layout and compiled layers (torch FSDP2) at the proxy's sequence, batch and schedule; the
micro-batch is the global batch over the GPUs (:func:`shape_overrides`). Every layer in FP8 under either preset: of 4
layers the tensor-wise preset would keep 2 in bf16, where llama8b keeps 2 of 32."""
SHAPES = {"proxy": MODEL, "llama8b": LLAMA8B_LAYERS}
TOKENS_PER_ITERATION = 32 * 1024


def shape_overrides(shape: str, gpus: int) -> list[str]:
    """The model and training overrides of ``--shape`` on ``gpus`` GPUs."""
    if shape == "proxy":
        return MODEL
    return [*LLAMA8B_LAYERS, f"train.micro_batch_size={32 // gpus}"]


def command(*args: str, gpus: int = 1) -> str:
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(gpus)] if gpus > 1 else []
    result = subprocess.run([sys.executable, *launcher, "-m", "bridge_cli", *args], capture_output=True, text=True,
                            check=False)
    if result.returncode:
        sys.exit(f"bridge {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235, 1236])
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--shape", choices=list(SHAPES), default="proxy")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs (torchrun) of every run; 32 must divide by it")
    args = parser.parse_args()
    if args.gpus < 1 or 32 % args.gpus:
        parser.error(f"--gpus {args.gpus}: the global batch of 32 rows must split evenly over the GPUs")
    require_cuda("fp8_convergence.py trains in FP8 on a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "fp8_convergence" if args.shape == "proxy" else f"fp8_convergence_{args.shape}"
    results_file = args.out / f"{name}.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    with tempfile.TemporaryDirectory() as folder:
        prefix = Path(folder) / "stdlib"
        command("preprocess-data", "--input", str(_stdlib_jsonl(Path(folder) / "stdlib.jsonl")),
                "--output-prefix", str(prefix), "--tokenizer-type", "ByteLevelTokenizer", "--workers", "8")
        for seed in args.seeds:
            for run in args.runs:
                out = command("pretrain", *shape_overrides(args.shape, args.gpus), f"dataset.blend=[{prefix}]",
                              f"rng.seed={seed}", f"train.train_iters={args.iters}",
                              f"scheduler.lr_decay_iters={args.iters}", f"train.eval_interval={args.iters + 1}",
                              *RUNS[run], gpus=args.gpus)
                curve = [(int(i), float(ms), float(loss)) for i, ms, loss in ITERATION.findall(out)]
                results[f"{run} seed {seed}"] = {
                    "run": run, "seed": seed, "iters": args.iters, "curve": [loss for _, _, loss in curve],
                    "validation": float(VALIDATION.search(out).group(1)),
                    "tokens_per_s": TOKENS_PER_ITERATION / args.gpus / statistics.median(
                        ms for _, ms, _ in curve[10:]) * 1000}
                results_file.write_text(json.dumps(results))
    _write_curves(results, args.out / f"{name}.csv", args.shape)
    _report(results)


def _report(results: dict) -> None:
    runs = {}
    for result in results.values():
        runs.setdefault(result["run"], []).append(result)
    base = statistics.mean(r["validation"] for r in runs["bf16"]) if "bf16" in runs else None
    print(f"\n{'run':<16} {'seeds':>5} {'validation loss (each seed)':>40} {'mean':>7} {'vs bf16':>8} {'tok/s/GPU':>9}")
    for name, rows in runs.items():
        rows.sort(key=lambda r: r["seed"])
        mean = statistics.mean(r["validation"] for r in rows)
        versus = f"{mean / base - 1:>+8.2%}" if base and name != "bf16" else f"{'':>8}"
        each = " ".join(f"{r['validation']:.4f}" for r in rows)
        tok_s = statistics.median(r["tokens_per_s"] for r in rows)
        print(f"{name:<16} {len(rows):>5} {each:>40} {mean:>7.4f} {versus} {tok_s:>9,.0f}")
    if len(runs.get("bf16", [])) > 1:
        values = [r["validation"] for r in runs["bf16"]]
        print(f"bf16's own spread over seeds: {(max(values) - min(values)) / base:.2%} of its mean "
              f"(standard deviation {statistics.stdev(values) / base:.2%})")
    print("(validation: 8 held-out batches of the standard library's *.py, byte-level, after each run's last iteration)")


def _write_curves(results: dict, out: Path, shape: str) -> None:
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["iteration", *results])
        for i, losses in enumerate(zip(*(r["curve"] for r in results.values())), start=1):
            writer.writerow([i, *losses])
    _plot(results, out.with_suffix(".png"), shape)


def _stdlib_jsonl(path: Path) -> Path:
    """The standard library's ``*.py`` files (site-packages left out) as JSON lines, one document a file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    with open(path, "w") as f:
        for file in sorted(root.rglob("*.py")):
            if {"site-packages", "dist-packages"}.isdisjoint(file.relative_to(root).parts):
                f.write(json.dumps({"text": file.read_text(errors="replace")}) + "\n")
    return path


def _plot(results: dict, path: Path, shape: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = dict(zip(RUNS, ("tab:blue", "tab:orange", "tab:green")))
    for label, result in results.items():
        ax.plot(range(1, len(result["curve"]) + 1), result["curve"], label=label, linewidth=0.8,
                color=colors.get(result["run"]), alpha=0.7)
    ax.set(xlabel="iteration", ylabel="lm loss", ylim=(0.6, 3.0),
           title=f"FP8 vs bf16, Python standard library (byte-level), {shape} shape")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
