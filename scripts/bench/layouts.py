"""One recipe under several parallel layouts on one GPU host: loss curves and throughput side by side.

    python scripts/bench/layouts.py --recipe llama1b --iters 30 --layouts 1 dp2 tp2 pp2 [-- OVERRIDES...]

A layout is ``1`` (one GPU) or a ``+``-joined list of ``tpN``/``ppN``/``dpN``/``vppN`` (``tp2+dp2``);
its world size is their product. Layouts run at the same time on disjoint GPUs when the host has
enough (``--serial`` runs them one after another, for clean timings), each under torchrun; without a GPU
they run one after another on the CPU (gloo), where only the loss curves mean something.
Prints, per layout: ms/iter and tokens/s per GPU (median of the log lines after the first),
model TFLOP/s per GPU, MFU, tokens/s of the whole layout and its scaling over the one-GPU run,
and the largest relative difference of its loss curve from the first layout's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

LINE = re.compile(r"^iteration\s+(\d+)/\d+ \| .*?elapsed ms/iter ([0-9.]+) \| tokens/s/gpu ([0-9,]+) \| "
                  r"TFLOP/s/gpu ([0-9.]+) .*?\| lm loss ([0-9.]+)", re.M)
PEAK = re.compile(r"peak allocated ([0-9.]+) GiB")
PEAK_TFLOPS = 989.0


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_layout(name: str) -> dict[str, int]:
    sizes = {"tp": 1, "pp": 1, "dp": 1, "vpp": 0}
    if name != "1":
        for part in name.split("+"):
            match = re.fullmatch(r"(tp|pp|dp|vpp)(\d+)", part)
            if not match:
                raise ValueError(f"layout {name!r}: {part!r} is none of tpN, ppN, dpN, vppN")
            sizes[match.group(1)] = int(match.group(2))
    sizes["world"] = sizes["tp"] * sizes["pp"] * sizes["dp"]
    return sizes


def launch(name: str, gpus: list[str] | None, args, port: int) -> subprocess.Popen:
    """torchrun for the layout ``name`` on ``gpus`` (None: on the CPU)."""
    s = parse_layout(name)
    overrides = [f"recipe={args.recipe}", f"train.train_iters={args.iters}", f"logger.log_interval={args.log_interval}",
                 "train.eval_iters=0", f"model.tensor_model_parallel_size={s['tp']}",
                 f"model.pipeline_model_parallel_size={s['pp']}", *args.overrides]
    if s["vpp"]:
        overrides.append(f"model.virtual_pipeline_model_parallel_size={s['vpp']}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(s["world"]),
           "--master-port", str(port), "-m", "bridge_cli", "pretrain", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else {})}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def summarize(name: str, output: str, returncode: int) -> dict:
    rows = [(int(i), float(ms), int(tok.replace(",", "")), float(tf), float(loss))
            for i, ms, tok, tf, loss in LINE.findall(output)]
    if returncode or not rows:
        return {"layout": name, "failed": returncode, "tail": output[-4000:]}
    timed = rows[1:] or rows
    peaks = [float(p) for p in PEAK.findall(output)]
    world = parse_layout(name)["world"]
    tok = statistics.median(r[2] for r in timed)
    return {"layout": name, "gpus": world, "ms_iter": statistics.median(r[1] for r in timed), "tok_s_gpu": tok,
            "tok_s_total": tok * world, "tflops_gpu": statistics.median(r[3] for r in timed),
            "peak_GiB": max(peaks) if peaks else math.nan, "loss": {r[0]: r[4] for r in rows},
            "nan": any(math.isnan(r[4]) for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="llama1b")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--log-interval", type=int, default=5)
    parser.add_argument("--layouts", nargs="+", default=["1", "dp2", "tp2", "pp2"])
    parser.add_argument("--serial", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    try:
        worlds = {name: parse_layout(name)["world"] for name in args.layouts}
    except ValueError as error:
        parser.error(str(error))
    import torch

    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        free = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        too_large = [f"{name} ({world})" for name, world in worlds.items() if world > len(free)]
        if too_large:
            parser.error(f"{len(free)} GPUs visible; layouts with more GPUs: {', '.join(too_large)}")
    else:
        print("no GPU visible: the layouts run one after another on the CPU (gloo)", flush=True)
        free, args.serial = [None] * max(worlds.values()), True  # a place per process, not a GPU
    running, results = [], {}
    pending = list(args.layouts)
    while pending or running:
        while pending and len(free) >= worlds[pending[0]] and not (args.serial and running):
            name = pending.pop(0)
            gpus = [free.pop(0) for _ in range(worlds[name])]
            on_gpus = None if gpus[0] is None else gpus
            running.append((name, gpus, launch(name, on_gpus, args, free_port()), time.time()))
            where = f"GPUs {gpus}" if on_gpus else f"the CPU, {len(gpus)} process(es)"
            print(f"started {name} on {where}", flush=True)
        name, gpus, proc, started = running.pop(0)
        output = proc.communicate()[0]
        results[name] = summarize(name, output, proc.returncode)
        results[name]["wall_s"] = round(time.time() - started, 1)
        print(f"finished {name} in {results[name]['wall_s']} s", flush=True)
        free.extend(gpus)

    base = results[args.layouts[0]]
    one = results.get("1", base)
    print(f"\n{'layout':<14} {'GPUs':>4} {'ms/iter':>8} {'tok/s/GPU':>10} {'tok/s all':>10} {'scaling':>7} "
          f"{'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8} {'max rel loss diff':>17}")
    for name in args.layouts:
        r = results[name]
        if "failed" in r:
            print(f"{name:<14} FAILED (exit {r['failed']}):\n{r['tail']}")
            continue
        common = set(r["loss"]) & set(base["loss"])
        diff = max(abs(r["loss"][i] - base["loss"][i]) / base["loss"][i] for i in common) if common else math.nan
        scaling = r["tok_s_total"] / one["tok_s_total"] if "tok_s_total" in one else math.nan
        print(f"{name:<14} {r['gpus']:>4} {r['ms_iter']:>8.1f} {r['tok_s_gpu']:>10,.0f} {r['tok_s_total']:>10,.0f} "
              f"{scaling:>7.2f} {r['tflops_gpu']:>8.1f} {r['tflops_gpu'] / PEAK_TFLOPS:>6.1%} {r['peak_GiB']:>8.1f} "
              f"{diff:>17.4f}{'  NaN!' if r['nan'] else ''}")
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
