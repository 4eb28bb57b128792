"""FP8 against bf16 on real text, one GPU: the Python standard library's source, byte-level tokens.

    python scripts/bench/fp8_convergence.py [--iters 300] [--out DIR]

Every machine has this corpus: the ``*.py`` files of the running interpreter's standard library,
tokenized with ``bridge preprocess-data --tokenizer-type ByteLevelTokenizer``. The same small
Llama-style model (8 layers, hidden 1024, SwiGLU FFN 4096, GQA 16/4, seq 1024, global batch 32)
trains ``--iters`` iterations in bf16 (eager and compiled) and with each FP8 preset (which compile
the layers), from the same seed on the same batches. Prints each run's final loss (the mean of the
last 20 iterations), its relative difference to its baseline (the FP8 runs: bf16 compiled) and
its tokens/s, and writes the curves to DIR/fp8_convergence.csv (and a
plot, DIR/fp8_convergence.png, where matplotlib imports).
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

RUNS = {"bf16": ["mixed_precision=bf16_mixed", "model.compile_layers=false"],
        "bf16 compiled": ["mixed_precision=bf16_mixed", "model.compile_layers=true"],
        "fp8 tensorwise": ["mixed_precision=bf16_with_fp8_current_scaling_mixed"],
        "fp8 rowwise": ["mixed_precision=bf16_with_fp8_rowwise_mixed"]}
"""Each run's overrides. The FP8 presets compile the layers, so they compare with "bf16 compiled"."""
BASELINE = {"bf16 compiled": "bf16", "fp8 tensorwise": "bf16 compiled", "fp8 rowwise": "bf16 compiled"}
ITERATION = re.compile(r"^iteration\s+(\d+)/\d+ \| .*?elapsed ms/iter ([0-9.]+) .*?lm loss ([0-9.]+) ", re.M)
MODEL = ["recipe=llama1b", "model.num_layers=8", "model.hidden_size=1024", "model.ffn_hidden_size=4096",
         "model.num_attention_heads=16", "model.num_query_groups=4", "model.seq_length=1024",
         "model.share_embeddings_and_output_weights=true", "tokenizer=byte_level", "dataset=gpt",
         "dataset.split='98,2,0'", "train.micro_batch_size=16", "train.global_batch_size=32", "train.eval_iters=0",
         "optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "scheduler.lr_warmup_iters=30", "logger.log_interval=1"]


def command(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "bridge_cli", *args], capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"bridge {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        prefix = Path(folder) / "stdlib"
        command("preprocess-data", "--input", str(Path(sysconfig.get_paths()["stdlib"]) / "*.py"),
                "--output-prefix", str(prefix), "--tokenizer-type", "ByteLevelTokenizer", "--workers", "8")
        curves = {}
        for name, overrides in RUNS.items():
            out = command("pretrain", *MODEL, f"dataset.blend=[{prefix}]", f"train.train_iters={args.iters}",
                          f"scheduler.lr_decay_iters={args.iters}", *overrides)
            curves[name] = [(int(i), float(ms), float(loss)) for i, ms, loss in ITERATION.findall(out)]
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "fp8_convergence.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["iteration", *curves])
        for rows in zip(*curves.values()):
            writer.writerow([rows[0][0], *(loss for _, _, loss in rows)])
    _plot(curves, args.out / "fp8_convergence.png")
    final = {name: statistics.mean(loss for _, _, loss in rows[-20:]) for name, rows in curves.items()}
    tokens = 32 * 1024
    print(f"\n{'run':<16} {'final loss':>10} {'vs':>14} {'difference':>10} {'tok/s':>9}")
    for name, rows in curves.items():
        tok_s = tokens / statistics.median(ms for _, ms, _ in rows[10:]) * 1000
        base = BASELINE.get(name)
        versus = f"{base:>14} {final[name] / final[base] - 1:>+10.2%}" if base else f"{'':>14} {'':>10}"
        print(f"{name:<16} {final[name]:>10.4f} {versus} {tok_s:>9,.0f}")
    print(f"(final loss: mean of the last 20 of {args.iters} iterations; standard library *.py, byte-level tokens)")


def _plot(curves: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in curves.items():
        ax.plot([i for i, _, _ in rows], [loss for _, _, loss in rows], label=name, linewidth=1)
    ax.set(xlabel="iteration", ylabel="lm loss", title="FP8 vs bf16, Python standard library (byte-level)")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
