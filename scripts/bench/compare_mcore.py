"""bridge vs bare megatron-core on the same model, same batch, in one run on one GPU.

    python scripts/bench/compare_mcore.py [--baseline PATH] [--steps 12] [--variant mbs2:train.micro_batch_size=2 ...]
        [--titan [PATH]]

Runs mcore_baseline.py, in this folder (a bare megatron-core loop: SDPA core attention, distributed
optimizer, bf16) and `bridge pretrain recipe=llama1b` set to the same shape (the 1.5B proxy:
16 layers, hidden 2048, GQA 32/8, FFN 8192, vocab 128256, seq 4096, micro-batch 1, global
batch 8, untied embeddings), then prints tokens/s/GPU, model TFLOP/s/GPU, MFU, peak memory,
ms/step and the ratio bridge / bare, and each run's launch time: seconds from its launch to its first
step's log line (imports, set-up, the first step and any compilation in it; a first process imports the
libraries once so no row pays their cold read from disk). Each run's first --warmup steps are not timed. Each
``--variant NAME:OVERRIDE[,OVERRIDE...]`` adds a bridge run with those overrides on top (a lever
to measure), with its ratio to bare megatron-core.

``--documents N`` measures per-document attention: it writes an indexed dataset of documents of
seq/N tokens (each ending with the end-of-document token, so about N per row) and adds two runs
on it, ``docsN causal`` (attention across documents, the causal kernel) and ``docsN masked``
(``dataset.reset_attention_mask=true reset_position_ids=true``: FlexAttention with per-document
block masks), and prints masked / causal tokens/s.

``--titan`` adds torchtitan (``run_titan.py`` in this folder, with the wheels its docstring lists) at its best
setting, micro-batch 4 x 2 compiled, to the same table; each
``--titan-variant NAME:FLAGS`` adds a torchtitan run at that setting with its own flags on top, e.g.
``fp8tw:--model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name tensorwise``
(float8 through torchao, whose wheel must be installed too). A run that fails (out of memory, say)
is a row that says so; the others go on.
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
import threading
import time
from pathlib import Path

from gpu_timing import require_cuda  # this folder's helper

H100_BF16_PEAK_TFLOPS = 989.0
ITER_LINE = re.compile(r"^iteration\s+(\d+)/\d+ \| .*?elapsed ms/iter ([0-9.]+) .*?TFLOP/s/gpu ([0-9.]+)", re.M)
PEAK = re.compile(r"memory at the end of training .*peak allocated ([0-9.]+) GiB")
START_UP = re.compile(r"^start-up .*$", re.M)
FIRST_ITERATION = re.compile(r"^iteration\s+1/")  # bridge's first step's log line, for run()
# bridge's own one-line error (every rank prints it), else the last exception's line (torchrun prefixes "[rankN]: ")
BRIDGE_ERROR = re.compile(r"^(?:\[rank\d+\]:\s*)?(error: .*)$", re.M)
EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b:? .*)$", re.M)
HEADER = (f"{'run':<16} {'ms/step':>8} {'tok/s/gpu':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} {'wall s':>7} "
          f"{'1st step s':>10} {'tok/s ratio':>11} {'mem ratio':>9} {'1st ratio':>9}")  # row()'s columns

PROXY_OVERRIDES = [
    "recipe=llama1b", "model.share_embeddings_and_output_weights=false", "model.spec=torch",
    "train.micro_batch_size=1", "model.compile_layers=false", "train.global_batch_size=8", "model.seq_length=4096",
    "train.eval_iters=0", "logger.log_interval=1", "scheduler.lr_warmup_iters=1", "scheduler.lr_decay_iters=1000",
    "dataset.num_workers=2", "model.gradient_accumulation_fusion=false",  # bare megatron-core has no Apex for it
    "model.cross_entropy_fusion_impl=native",  # bare megatron-core's loss; llama1b's triton one is a lever
    "model.fused_single_qkv_rope=false",  # bare megatron-core's split and RoPE; llama1b's fused one is a lever
]


class RunFailed(RuntimeError):
    """A run exited with an error (an out-of-memory variant, say): the table shows it and goes on."""


def run(argv: list[str], first_step: re.Pattern) -> tuple[str, float, float]:
    """Run ``argv``; returns its stdout, its wall time and the seconds from its launch to the first line of
    stdout or stderr that matches ``first_step`` (the first training step's log line), read as it is written."""
    start = time.time()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seen: list[float] = []

    def read(stream, lines: list[str]) -> None:
        for line in stream:
            if not seen and first_step.search(line):
                seen.append(time.time() - start)
            lines.append(line)

    out, err = [], []
    readers = [threading.Thread(target=read, args=pair) for pair in ((process.stdout, out), (process.stderr, err))]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    stdout, stderr = "".join(out), "".join(err)
    if process.wait():
        print(f"{' '.join(argv)} failed:\n{stdout[-2000:]}\n{stderr[-2000:]}", file=sys.stderr)
        raise RunFailed(error_line(stdout, stderr))
    return stdout, time.time() - start, seen[0] if seen else float("nan")


def error_line(stdout: str, stderr: str) -> str:
    """The line that says why a run failed: bridge's ``error: ...``, else the last exception that is not torchrun's
    report of its failed workers (ChildFailedError), else the last line of output."""
    bridge_error = BRIDGE_ERROR.search(stderr) or BRIDGE_ERROR.search(stdout)
    exceptions = [e for e in EXCEPTION.findall(stderr) if "ChildFailedError" not in e]
    line = (bridge_error.group(1) if bridge_error else exceptions[-1] if exceptions else
            (stderr.strip() or stdout.strip() or "no output").splitlines()[-1])
    return line.strip()[:200]


def warm_file_cache(titan: bool) -> None:
    """Import what the runs import once, so that no row pays the first read of the libraries from disk."""
    modules = "torch, megatron.core.models.gpt, megatron.core.optimizer" + (", torchtitan.train" if titan else "")
    subprocess.run([sys.executable, "-c", f"import {modules}"], capture_output=True)


def bare(baseline: Path, steps: int, warmup: int) -> dict:
    out, wall, first = run([sys.executable, str(baseline), "--steps", str(steps), "--warmup", str(warmup)],
                           re.compile(r"^step 0 loss"))
    res = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    return {"step_ms": res["step_ms"], "tok_s_gpu": res["tok_s_gpu"], "tflops_gpu": res["tflops_gpu"],
            "peak_mem_GiB": res["peak_mem_GiB"], "to_first_step_s": first, "wall_s": wall,
            "imports_s": res["import_torch_s"] + res["import_mcore_s"]}


def titan(script: Path, steps: int, warmup: int, flags: list[str] = ()) -> dict:
    """torchtitan at its best setting measured so far: 4 sequences a micro-batch, 2 micro-batches, compiled;
    ``flags`` go to its trainer."""
    out, wall, first = run([sys.executable, str(script), "--local-batch", "4", "--grad-accum", "2", "--compile",
                            "--steps", str(steps), "--warmup", str(warmup), *(["--", *flags] if flags else [])],
                           re.compile(r"step:\s+1\s"))
    res = json.loads(out.strip().splitlines()[-1])
    return {"step_ms": res["step_ms_median"], "tok_s_gpu": round(res["tokens_per_s"]),
            "tflops_gpu": res["tflops_per_s"], "peak_mem_GiB": res["peak_mem_gib"], "wall_s": wall,
            "to_first_step_s": first}


def bridge(steps: int, warmup: int, extra: list[str]) -> dict:
    total = steps + warmup
    out, wall, first = run([sys.executable, "-m", "bridge_cli", "pretrain", *PROXY_OVERRIDES,
                            f"train.train_iters={total}", *extra], FIRST_ITERATION)
    rows = [(int(i), float(ms), float(tf)) for i, ms, tf in ITER_LINE.findall(out) if int(i) > warmup]
    step_ms = statistics.median(ms for _, ms, _ in rows)
    tflops = statistics.median(tf for _, _, tf in rows)
    tokens = 8 * 4096
    peak = PEAK.search(out)
    return {"step_ms": round(step_ms, 1), "tok_s_gpu": round(tokens / step_ms * 1000), "tflops_gpu": round(tflops, 1),
            "peak_mem_GiB": float(peak.group(1)) if peak else float("nan"), "wall_s": wall, "to_first_step_s": first,
            "start_up": START_UP.search(out).group(0) if START_UP.search(out) else None}


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
    parser.add_argument("--baseline", type=Path, default=Path(__file__).with_name("mcore_baseline.py"),
                        help="the bare megatron-core loop (default: mcore_baseline.py in this folder)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:OVERRIDES")
    parser.add_argument("--documents", type=int, default=0, metavar="N",
                        help="also run causal vs per-document masked attention on rows of about N documents")
    parser.add_argument("--titan", type=Path, nargs="?", const=Path(__file__).with_name("run_titan.py"),
                        metavar="RUN_TITAN_PY", help="also run torchtitan at 4 x 2, compiled (default: run_titan.py in "
                        "this folder)")
    parser.add_argument("--titan-variant", action="append", default=[], metavar="NAME:FLAGS",
                        help="also run torchtitan at 4 x 2 compiled with these trainer flags (needs --titan)")
    args = parser.parse_args()
    if args.titan_variant and not args.titan:
        parser.error("--titan-variant needs --titan")
    for script in (args.baseline, args.titan):
        if script and not script.is_file():
            parser.error(f"no such file: {script}")
    require_cuda("compare_mcore.py measures on a CUDA GPU (the bare megatron-core loop runs on CUDA with NCCL)")
    runs = {"bare mcore": lambda: bare(args.baseline, args.steps, args.warmup)}
    if args.titan:
        runs["titan 4x2 comp"] = lambda: titan(args.titan, args.steps, args.warmup)
    for variant in args.titan_variant:
        name, flags = variant.split(":", 1)
        runs[f"titan {name}"] = lambda f=flags.split(): titan(args.titan, args.steps, args.warmup, f)
    runs["bridge"] = lambda: bridge(args.steps, args.warmup, [])
    for variant in args.variant:
        name, overrides = variant.split(":", 1)
        runs[f"bridge {name}"] = lambda o=overrides.split(","): bridge(args.steps, args.warmup, o)
    folder = tempfile.TemporaryDirectory()
    if args.documents:
        # twice the rows training reads: megatron-core's split and shuffle take whole documents
        prefix = document_dataset(Path(folder.name), args.documents, rows=2 * 8 * (args.steps + args.warmup))
        data = ["dataset=gpt", f"dataset.blend=[{prefix}]", "dataset.split='100,0,0'"]
        runs[f"bridge docs{args.documents} causal"] = lambda: bridge(args.steps, args.warmup, data)
        runs[f"bridge docs{args.documents} masked"] = lambda: bridge(
            args.steps, args.warmup, data + ["dataset.reset_attention_mask=true", "dataset.reset_position_ids=true"])

    warm_file_cache(bool(args.titan))
    results: dict[str, dict] = {}
    print(HEADER, flush=True)
    for name, measure in runs.items():  # each row as its run ends, so a cut-off command still reports
        try:
            results[name] = measure()
        except RunFailed as failure:
            results[name] = {"error": str(failure)}
        print(row(name, results[name], results.get("bare mcore")), flush=True)
    folder.cleanup()
    print(f"\n{HEADER}")
    for name, r in results.items():
        print(row(name, r, results["bare mcore"]))
    print("(1st step s: from the launch to the first step's log line, compilation included; ratios: each run / bare "
          "megatron-core)")
    docs = [results.get(f"bridge docs{args.documents} {kind}", {}) for kind in ("causal", "masked")]
    if args.documents and all("tok_s_gpu" in r for r in docs):
        print(f"per-document masked / causal tokens/s with {args.documents} documents per row: "
              f"{docs[1]['tok_s_gpu'] / docs[0]['tok_s_gpu']:.3f}")
    print("RESULTS " + json.dumps(results))


def row(name: str, r: dict, bare_run: dict | None) -> str:
    if "error" in r:
        return f"{name:<16} failed: {r['error']}"
    mfu = r["tflops_gpu"] / H100_BF16_PEAK_TFLOPS
    line = (f"{name:<16} {r['step_ms']:>8.1f} {r['tok_s_gpu']:>10,} {r['tflops_gpu']:>8.1f} {mfu:>6.1%} "
            f"{r['peak_mem_GiB']:>9.1f} {r['wall_s']:>7.1f} {r['to_first_step_s']:>10.1f}")
    if bare_run and "tok_s_gpu" in bare_run:
        line += (f" {r['tok_s_gpu'] / bare_run['tok_s_gpu']:>11.3f} {r['peak_mem_GiB'] / bare_run['peak_mem_GiB']:>9.3f}"
                 f" {r['to_first_step_s'] / bare_run['to_first_step_s']:>9.3f}")
    return line


if __name__ == "__main__":
    main()
