"""bridge vs bare megatron-core on the same model, same batch, in one run on one GPU.

    python scripts/bench/compare_mcore.py [--baseline ../shared/bench/mcore_baseline.py] [--steps 12]
        [--variant mbs2:train.micro_batch_size=2 ...]

Runs shared/bench/mcore_baseline.py (a bare megatron-core loop: SDPA core attention, distributed
optimizer, bf16) and `bridge pretrain recipe=llama1b` set to the same shape (the 1.5B proxy:
16 layers, hidden 2048, GQA 32/8, FFN 8192, vocab 128256, seq 4096, micro-batch 1, global
batch 8, untied embeddings), then prints tokens/s/GPU, model TFLOP/s/GPU, MFU, peak memory,
ms/step and the ratio bridge / bare. Each run's first --warmup steps are not timed. Each
``--variant NAME:OVERRIDE[,OVERRIDE...]`` adds a bridge run with those overrides on top (a lever
to measure), with its ratio to bare megatron-core.

``--documents N`` measures per-document attention: it writes an indexed dataset of documents of
seq/N tokens (each ending with the end-of-document token, so about N per row) and adds two runs
on it, ``docsN causal`` (attention across documents, the causal kernel) and ``docsN masked``
(``dataset.reset_attention_mask=true reset_position_ids=true``: FlexAttention with per-document
block masks), and prints masked / causal tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

H100_BF16_PEAK_TFLOPS = 989.0
ITER_LINE = re.compile(r"^iteration\s+(\d+)/\d+ \| .*?elapsed ms/iter ([0-9.]+) .*?TFLOP/s/gpu ([0-9.]+)", re.M)
PEAK = re.compile(r"memory at the end of training .*peak allocated ([0-9.]+) GiB")

PROXY_OVERRIDES = [
    "recipe=llama1b", "model.share_embeddings_and_output_weights=false", "model.spec=torch",
    "train.micro_batch_size=1", "model.compile_layers=false", "train.global_batch_size=8", "model.seq_length=4096",
    "train.eval_iters=0", "logger.log_interval=1", "scheduler.lr_warmup_iters=1", "scheduler.lr_decay_iters=1000",
    "dataset.num_workers=2",
]


def run(argv: list[str]) -> tuple[str, float]:
    start = time.time()
    result = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if result.returncode:
        sys.exit(f"{' '.join(argv)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout, time.time() - start


def bare(baseline: Path, steps: int, warmup: int) -> dict:
    out, wall = run([sys.executable, str(baseline), "--steps", str(steps), "--warmup", str(warmup)])
    res = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    return {"step_ms": res["step_ms"], "tok_s_gpu": res["tok_s_gpu"], "tflops_gpu": res["tflops_gpu"],
            "peak_mem_GiB": res["peak_mem_GiB"], "to_first_step_s": res["to_first_step_done_s"], "wall_s": wall}


def bridge(steps: int, warmup: int, extra: list[str]) -> dict:
    total = steps + warmup
    out, wall = run([sys.executable, "-m", "bridge_cli", "pretrain", *PROXY_OVERRIDES, f"train.train_iters={total}",
                     *extra])
    rows = [(int(i), float(ms), float(tf)) for i, ms, tf in ITER_LINE.findall(out) if int(i) > warmup]
    step_ms = statistics.median(ms for _, ms, _ in rows)
    tflops = statistics.median(tf for _, _, tf in rows)
    tokens = 8 * 4096
    peak = PEAK.search(out)
    return {"step_ms": round(step_ms, 1), "tok_s_gpu": round(tokens / step_ms * 1000), "tflops_gpu": round(tflops, 1),
            "peak_mem_GiB": float(peak.group(1)) if peak else float("nan"), "wall_s": wall}


def document_dataset(folder: Path, documents_per_row: int, rows: int, seq: int = 4096, vocab: int = 128256) -> Path:
    """An indexed dataset of ``rows`` rows' worth of documents of ``seq / documents_per_row`` tokens, eod last."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = folder / f"docs{documents_per_row}"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    length, rng = seq // documents_per_row, np.random.default_rng(0)
    for _ in range(rows * documents_per_row):
        # the null tokenizer's end-of-document id is its last one (vocab - 1)
        document = np.append(rng.integers(0, vocab - 1, length - 1, dtype=np.int32), vocab - 1)
        builder.add_document(torch.from_numpy(document), [length])
    builder.finalize(f"{prefix}.idx")
    return prefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, default=Path(__file__).resolve().parents[3] / "shared/bench/mcore_baseline.py")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:OVERRIDES")
    parser.add_argument("--documents", type=int, default=0, metavar="N",
                        help="also run causal vs per-document masked attention on rows of about N documents")
    args = parser.parse_args()
    results = {"bare mcore": bare(args.baseline, args.steps, args.warmup), "bridge": bridge(args.steps, args.warmup, [])}
    for variant in args.variant:
        name, overrides = variant.split(":", 1)
        results[f"bridge {name}"] = bridge(args.steps, args.warmup, overrides.split(","))
    if args.documents:
        with tempfile.TemporaryDirectory() as folder:
            # twice the rows training reads: megatron-core's split and shuffle take whole documents
            prefix = document_dataset(Path(folder), args.documents, rows=2 * 8 * (args.steps + args.warmup))
            data = ["dataset=gpt", f"dataset.blend=[{prefix}]", "dataset.split='100,0,0'"]
            causal = results[f"bridge docs{args.documents} causal"] = bridge(args.steps, args.warmup, data)
            masked = results[f"bridge docs{args.documents} masked"] = bridge(
                args.steps, args.warmup, data + ["dataset.reset_attention_mask=true", "dataset.reset_position_ids=true"])
    m = results["bare mcore"]
    print(f"\n{'run':<16} {'ms/step':>8} {'tok/s/gpu':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} {'wall s':>7} "
          f"{'tok/s ratio':>11} {'mem ratio':>9}")
    for name, r in results.items():
        mfu = r["tflops_gpu"] / H100_BF16_PEAK_TFLOPS
        print(f"{name:<16} {r['step_ms']:>8.1f} {r['tok_s_gpu']:>10,} {r['tflops_gpu']:>8.1f} {mfu:>6.1%} "
              f"{r['peak_mem_GiB']:>9.1f} {r['wall_s']:>7.1f} {r['tok_s_gpu'] / m['tok_s_gpu']:>11.3f} "
              f"{r['peak_mem_GiB'] / m['peak_mem_GiB']:>9.3f}")
    print("(ratios: each run / bare megatron-core)")
    if args.documents:
        print(f"per-document masked / causal tokens/s with {args.documents} documents per row: "
              f"{masked['tok_s_gpu'] / causal['tok_s_gpu']:.3f}")
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
