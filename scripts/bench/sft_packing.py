"""Packed against padded SFT on the same data, one GPU: samples and answer tokens per second.

    python scripts/bench/sft_packing.py [--recipe llama1b] [--seq 4096] [--records 4000] [--steps 12]

Writes JSONL records of byte-level text (at --seq 4096: prompts of 102-585 bytes, answers of
102-1365), makes a
starting checkpoint with one `bridge pretrain` step of the recipe's model (byte-level tokenizer,
torch spec), then fine-tunes it twice for the same steps and global batch: one sample per row
padded to --seq, and samples packed into rows of --seq (per-document masks). A padded row holds
one sample, a packed one as many as fit; the table gives ms/step, rows/s, samples/s and the
real (unpadded) tokens/s of each, and packed / padded. The first --warmup steps are not timed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from compare_mcore import FIRST_ITERATION, ITER_LINE, RunFailed, run

# megatron-core's fused QKV RoPE takes no packed sequences: both rows run the split and RoPE unfused
COMMON = ["tokenizer=byte_level", "model.spec=torch", "train.eval_iters=0", "logger.log_interval=1",
          "dataset.num_workers=2", "model.fused_single_qkv_rope=false"]


def write_records(folder: Path, count: int, seq: int) -> None:
    """Prompts of seq/40 to seq/7 bytes and answers of seq/40 to seq/3 (at 4096: 102-585 and 102-1365)."""
    rng = random.Random(0)
    text = lambda n: "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(n))
    with open(folder / "training.jsonl", "w") as f:
        for _ in range(count):
            record = {"input": text(rng.randint(seq // 40, seq // 7)), "output": text(rng.randint(seq // 40, seq // 3))}
            f.write(json.dumps(record) + "\n")


def samples_per_row(folder: Path, seq: int) -> tuple[float, float]:
    """Mean samples per packed row, and mean tokens per sample, as bridge tokenizes and packs them."""
    from bridge_cli.config.data_configs import TokenizerConfig
    from bridge_cli.data.sft import pack_rows, read_jsonl, sample_row
    from bridge_cli.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="ByteLevelTokenizer"))
    rows = [sample_row(s) for s in read_jsonl(folder / "training.jsonl", tokenizer, seq)]
    return len(rows) / len(pack_rows(rows, seq)), statistics.mean(len(r.tokens) for r in rows)


def bridge(*args: str) -> str:
    """The output of `bridge ARGS`; a failed run ends the script (run printed its command and output)."""
    try:
        return run([sys.executable, "-m", "bridge_cli", *args], FIRST_ITERATION)[0]
    except RunFailed as failure:
        sys.exit(f"sft_packing.py stops: {failure}")


def finetune(args, extra: list[str], base: Path, data: Path) -> float:
    out = bridge("finetune", f"recipe={args.recipe}", "dataset=finetune", *COMMON, f"model.seq_length={args.seq}",
                 f"dataset.dataset_root={data}", f"checkpoint.pretrained_checkpoint={base}",
                 f"train.train_iters={args.steps + args.warmup}", *extra)
    return statistics.median(float(ms) for i, ms, _ in ITER_LINE.findall(out) if int(i) > args.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="llama1b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_records(tmp, args.records, args.seq)
        per_row, tokens = samples_per_row(tmp, args.seq)
        bridge("pretrain", f"recipe={args.recipe}", *COMMON, f"model.seq_length={args.seq}", "train.train_iters=1",
               f"train.global_batch_size={args.global_batch}", f"checkpoint.save={tmp / 'base'}")
        batch = [f"train.global_batch_size={args.global_batch}"]
        padded = finetune(args, batch, tmp / "base", tmp)
        packed = finetune(args, [*batch, f"dataset.packed_sequence_specs.packed_sequence_size={args.seq}"],
                          tmp / "base", tmp)
    print(f"\n{args.records} records, {tokens:.0f} tokens per sample on average, {per_row:.2f} samples per packed "
          f"row of {args.seq}; global batch {args.global_batch} rows")
    print(f"{'run':<8} {'ms/step':>8} {'rows/s':>8} {'samples/s':>10} {'tokens/s':>10}")
    results = {}
    for name, ms, samples in (("padded", padded, 1.0), ("packed", packed, per_row)):
        rows_s = args.global_batch / ms * 1000
        results[name] = {"step_ms": ms, "rows_s": rows_s, "samples_s": rows_s * samples,
                         "tokens_s": rows_s * samples * tokens}
        r = results[name]
        print(f"{name:<8} {ms:>8.1f} {rows_s:>8.2f} {r['samples_s']:>10.1f} {r['tokens_s']:>10,.0f}")
    print(f"packed / padded samples/s: {results['packed']['samples_s'] / results['padded']['samples_s']:.2f}")
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
