"""DPO and distillation against SFT at the same model size, on one GPU: ms/iter, tokens/s/GPU, MFU, peak memory.

    python scripts/bench/objective_speed.py [--iters 12] [--warmup 3] [--global-batch 4]
        [--dpo-recipe llama8b_dpo_lora] [--distill-recipe llama1b_distill] [--teacher-recipe llama8b] [--work DIR]
        [-- OVERRIDE ...]

Downloads nothing. Into a temporary folder it writes a preference JSONL (prompt, chosen, rejected) and an SFT JSONL
(input, output) of random token ids, as the null tokenizer reads text (ids in decimal): prompts of an eighth of the
longest model.seq_length, responses longer than a row, so every row is full. Then one checkpoint of random weights
per model shape, each one `bridge pretrain` iteration: the DPO recipe's model (the base its LoRA adapts, and its
reference), the student's (where SFT and distillation start) and the teacher's (--teacher-recipe); a shape two of
them share is made once. These iterations run rows of 256 tokens, one a step, under SGD without momentum and with
bf16 gradients, so that an 8B model's step fits one 80 GB GPU.

The measured runs, `bridge finetune` for --iters iterations each, in this order:
1. ``sft (dpo shape)``: the DPO recipe with finetune.objective=sft, its LoRA kept, on the SFT data;
2. ``dpo``: the DPO recipe on the preference data;
3. ``sft (student)``: the distillation recipe with finetune.objective=sft;
4. ``distill``: the distillation recipe, distill.teacher_checkpoint the teacher's checkpoint.
Each with tokenizer=null_tokenizer, train.global_batch_size=--global-batch (pairs under DPO, rows otherwise), no
evaluation. The losses in the RESULTS line are each run's objective's (the log line's first: lm loss, dpo loss,
distill loss). OVERRIDEs after ``--`` apply to every run, the checkpoints' included (``model.num_layers=8`` makes the
8B models 8 layers deep; a recipe without model.vocab_size needs one, e.g. ``model.vocab_size=256``).

Prints a row per run as it ends, then the table: ms/iter (median after the first --warmup), tokens/s/GPU (DPO counts
both rows of a pair), TFLOP/s/GPU and MFU as bridge counts them (bridge_cli/models/flops.py: no weight gradients
for LoRA's frozen weights, the reference's or teacher's forward included; percent of 989 TFLOP/s, the H100's dense
bf16 peak), peak memory, then DPO's and distillation's tokens/s/GPU over their SFT's. A measured run that fails (out of memory, say) is a row with its error line; the others go on. On a
machine without a GPU every run goes to the CPU: a dry run whose numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
import tempfile
from pathlib import Path

from compare_mcore import FIRST_ITERATION, RunFailed, run
from moe_ep import report, summary

COMMON = ["tokenizer=null_tokenizer", "train.eval_iters=0", "logger.log_interval=1"]
BASE_SEQ = 256
"""Tokens of a row in the checkpoints' one iteration (RoPE has no weights: the runs take any model.seq_length)."""
BASE = ["finetune.objective=sft", "peft=null", "dataset=mock", "train.train_iters=1", "train.micro_batch_size=1",
        "train.global_batch_size=1", f"model.seq_length={BASE_SEQ}", "optimizer=sgd", "optimizer.sgd_momentum=0",
        "optimizer.use_distributed_optimizer=false", "ddp.grad_reduce_in_fp32=false",
        "model.gradient_accumulation_fusion=false", "checkpoint.save_optim=false"]
HEADER = f"{'run':<22} {'ms/iter':>8} {'tok/s/gpu':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}"  # report()'s columns
RECORDS = 64
"""Records a file: the runs read them over and over."""
OBJECTIVE_LOSS = re.compile(r"^iteration\s+(\d+)/\d+ .*? \| lr \S+ \| [a-z ]+? ([0-9.]+) \| ", re.M)
"""An iteration's objective loss: the first loss on the log line, after lr (lm loss, dpo loss or distill loss)."""


def sft_objective() -> list[str]:
    """finetune.objective=sft, and the dpo and distill sections at their defaults (SFT refuses them set otherwise)."""
    from bridge_cli.config.finetune_config import DistillConfig, DPOConfig

    resets = [f"{section}.{f.name}={'null' if f.default is None else f.default}"
              for section, config in (("dpo", DPOConfig), ("distill", DistillConfig))
              for f in dataclasses.fields(config)]
    return ["finetune.objective=sft", *resets]


def model_section(recipe: str, overrides: list[str]) -> dict:
    from omegaconf import OmegaConf

    from bridge_cli.config.compose import compose

    return OmegaConf.to_container(compose(recipe, overrides).model, resolve=True)


def write_data(folder: Path, vocab: int, prompt: int, response: int) -> tuple[Path, Path]:
    """(SFT folder, preference folder), each with a training.jsonl of random ids below the end-of-document id."""
    rng = random.Random(0)
    ids = lambda n: " ".join(str(rng.randrange(vocab - 1)) for _ in range(n))
    sft, pairs = folder / "sft", folder / "pairs"
    for path in (sft, pairs):
        path.mkdir()
    with open(sft / "training.jsonl", "w") as f:
        for _ in range(RECORDS):
            f.write(json.dumps({"input": ids(prompt), "output": ids(response)}) + "\n")
    with open(pairs / "training.jsonl", "w") as f:
        for _ in range(RECORDS):
            f.write(json.dumps({"prompt": ids(prompt), "chosen": ids(response), "rejected": ids(response)}) + "\n")
    return sft, pairs


def bridge(*args: str) -> str:
    """The output of ``bridge ARGS`` (run printed the command and its output if it failed)."""
    return run([sys.executable, "-m", "bridge_cli", *args], FIRST_ITERATION)[0]


def checkpoints(recipes: dict[str, str], overrides: list[str], folder: Path) -> dict[str, Path]:
    """name -> a checkpoint of random weights at that recipe's model shape with ``overrides``, one per shape."""
    made: list[tuple[dict, Path]] = []
    out = {}
    for name, recipe in recipes.items():
        args = [*COMMON, *sft_objective(), *overrides, *BASE]
        shape = model_section(recipe, args)
        out[name] = next((path for section, path in made if section == shape), None)
        if out[name] is None:
            out[name] = folder / name.replace(" ", "_")
            print(f"making the {name}'s checkpoint: one iteration of recipe={recipe}", flush=True)
            try:
                bridge("pretrain", f"recipe={recipe}", *args, f"checkpoint.save={out[name]}")
            except RunFailed as failure:
                sys.exit(f"objective_speed.py stops: the {name}'s checkpoint: {failure}")
            made.append((shape, out[name]))
    return out


def finetune(a, recipe: str, objective: list[str], data: Path, base: Path, *extra: str) -> list[str]:
    """`bridge finetune`'s arguments for a measured run of ``recipe`` (``objective``: overrides of its own) from
    ``base`` on ``data``."""
    return [f"recipe={recipe}", *COMMON, f"train.global_batch_size={a.global_batch}", *objective, *a.overrides,
            f"train.train_iters={a.iters}", f"dataset.dataset_root={data}", f"checkpoint.pretrained_checkpoint={base}",
            *extra]


def measure(args: list[str], warmup: int) -> dict:
    try:
        return summary(bridge("finetune", *args), warmup, loss=OBJECTIVE_LOSS)
    except RunFailed as failure:
        return {"error": str(failure)}


def row(name: str, r: dict) -> None:
    if "error" in r:
        print(f"{name:<22} failed: {r['error']}", flush=True)
    else:
        report(name, r)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=12, help="iterations of each measured run")
    parser.add_argument("--warmup", type=int, default=3, help="its first iterations, not timed")
    parser.add_argument("--global-batch", type=int, default=4, help="train.global_batch_size of every measured run "
                        "(pairs under DPO)")
    parser.add_argument("--dpo-recipe", default="llama8b_dpo_lora")
    parser.add_argument("--distill-recipe", default="llama1b_distill")
    parser.add_argument("--teacher-recipe", default="llama8b", help="the recipe whose model shape the teacher has")
    parser.add_argument("--work", type=Path, default=None, help="where the data and checkpoints go, removed at the "
                        "end (default: the system's temporary folder; an 8B model's checkpoint takes 16 GB)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of every run")
    args = parser.parse_args()
    if args.iters <= args.warmup:
        parser.error(f"--iters ({args.iters}) must be more than --warmup ({args.warmup}): the rest are timed")
    models = {recipe: model_section(recipe, [*COMMON, *args.overrides])
              for recipe in (args.dpo_recipe, args.distill_recipe)}
    unsized = [recipe for recipe, m in models.items() if m["vocab_size"] is None]
    if unsized:
        parser.error(f"recipe={unsized[0]} sets no model.vocab_size, which the null tokenizer takes its ids from: "
                     "add one after --, e.g. -- model.vocab_size=256")
    import torch

    if not torch.cuda.is_available():
        print("no GPU visible: every run goes to the CPU (gloo), numbers meaningless", flush=True)
    seqs = [m["seq_length"] for m in models.values()]
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        tmp = Path(tmp)
        sft_data, pairs = write_data(tmp, min(m["vocab_size"] for m in models.values()), max(1, min(seqs) // 8),
                                     max(seqs))
        ckpt = checkpoints({"DPO base": args.dpo_recipe, "student": args.distill_recipe,
                            "teacher": args.teacher_recipe}, args.overrides, tmp)
        sft = sft_objective()
        runs = {"sft (dpo shape)": finetune(args, args.dpo_recipe, sft, sft_data, ckpt["DPO base"]),
                "dpo": finetune(args, args.dpo_recipe, [], pairs, ckpt["DPO base"]),
                "sft (student)": finetune(args, args.distill_recipe, sft, sft_data, ckpt["student"]),
                "distill": finetune(args, args.distill_recipe, [], sft_data, ckpt["student"],
                                    f"distill.teacher_checkpoint={ckpt['teacher']}")}
        print(HEADER, flush=True)
        results = {}
        for name, run_args in runs.items():  # each row as its run ends, so a cut-off command still reports
            results[name] = measure(run_args, args.warmup)
            row(name, results[name])
    print(f"\n{args.iters} iterations, the first {args.warmup} not timed; global batch {args.global_batch}\n{HEADER}")
    for name, r in results.items():
        row(name, r)
    for objective, base in (("dpo", "sft (dpo shape)"), ("distill", "sft (student)")):
        ours, theirs = results[objective], results[base]
        ratio = ours["tokens"] / theirs["tokens"] if "error" not in ours and "error" not in theirs else float("nan")
        print(f"{objective} / {base} tokens/s/gpu: {ratio:.3f}")
    print("RESULTS " + json.dumps({name: {k: v for k, v in r.items() if k != "timers"} for name, r in results.items()}))


if __name__ == "__main__":
    main()
