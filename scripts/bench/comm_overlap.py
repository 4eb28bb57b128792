"""Step time with and without the communication overlap megatron-core runs without Transformer Engine, on N GPUs.

    python scripts/bench/comm_overlap.py --gpus 4 [--recipe llama1b] [--iters 20] [--warmup 5]
        [--settings NAME ...] [-- OVERRIDE ...]

Each setting is one `torchrun --nproc-per-node GPUS -m bridge_cli pretrain` of the recipe with the OVERRIDEs
and the setting's own (SETTINGS below), one after another. Two layouts: data parallelism over every GPU, with
the distributed optimizer (``none``, ``grad_reduce``, ``param_gather``, ``bucket_10m``, ``bucket_128mi``), and
PP=2 with two virtual stages each (megatron-core's interleaved schedule, the one that reads overlap_p2p_comm)
and data parallelism over the rest (``pp2_*``). A setting writes the megatron-core fields that the
``comm_overlap`` field of the same name writes (docs/parallelism.md#communication-overlap); it sets them
directly because the recipes set some of them already (``ddp.overlap_grad_reduce: true``), and a
``comm_overlap`` field that contradicts its target is refused:

    grad_reduce      comm_overlap.overlap_grad_reduce: ddp.overlap_grad_reduce
    param_gather     the same and comm_overlap.overlap_param_gather: ddp.* and optimizer.overlap_param_gather
    bucket_*         param_gather and comm_overlap.bucket_size: ddp.bucket_size (10,000,000 elements, and
                     Megatron-Bridge's 128 Mi; megatron-core's own is max(40,000,000, 1,000,000 x DP))
    pp2_batch_p2p    comm_overlap.batch_p2p_comm: model.batch_p2p_comm (one batch_isend_irecv per exchange)
    pp2_overlap_p2p  comm_overlap.overlap_p2p_comm: model.overlap_p2p_comm, with batch_p2p_comm false
    pp2_all          pp2_overlap_p2p, param_gather and comm_overlap.align_param_gather: ddp.align_param_gather

``none`` and ``pp2_none`` turn all of them off. Every run takes DEFAULTS (compiled layers off, so a run starts in
seconds, micro-batch 2) and dense_scale.py's (global batch 16, learning rates, ``scheduler.lr_decay_iters=ITERS``),
each where the OVERRIDEs do not set its key; an OVERRIDE of a key a setting sets is an error. The first
``--warmup`` iterations are not timed. Prints a row per run as it ends, then the table: setting, layout,
ms/step (median of the timed iterations' log lines), tokens/s/GPU (median) and the ratio of its tokens/s to
its layout's run with no overlap (above 1: faster). A run that fails (out of memory, a field refused) is a row
with its error line; the others go on.

On a machine without a GPU every run goes to the CPU (gloo): a dry run whose numbers mean nothing, and only
the settings without the distributed optimizer run there (``--settings none grad_reduce pp2_none ...`` with
``-- optimizer.use_distributed_optimizer=false``).
"""

from __future__ import annotations

import argparse
import json
import sys

from compare_mcore import RunFailed, warm_file_cache
from dense_scale import bridge, with_defaults

DEFAULTS = ["model.compile_layers=false", "train.micro_batch_size=2"]
OFF = ["ddp.overlap_grad_reduce=false", "ddp.overlap_param_gather=false", "optimizer.overlap_param_gather=false"]
GRAD_REDUCE = ["ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=false", "optimizer.overlap_param_gather=false"]
PARAM_GATHER = ["ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true", "optimizer.overlap_param_gather=true"]
PP2 = ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"]
NO_P2P = ["model.overlap_p2p_comm=false", "model.batch_p2p_comm=false"]
OVERLAP_P2P = ["model.overlap_p2p_comm=true", "model.batch_p2p_comm=false"]
SETTINGS: dict[str, list[str]] = {
    "none": OFF,
    "grad_reduce": GRAD_REDUCE,
    "param_gather": PARAM_GATHER,
    "bucket_10m": [*PARAM_GATHER, "ddp.bucket_size=10000000"],
    "bucket_128mi": [*PARAM_GATHER, f"ddp.bucket_size={128 * 1024 * 1024}"],
    "pp2_none": [*PP2, *OFF, *NO_P2P],
    "pp2_batch_p2p": [*PP2, *OFF, "model.overlap_p2p_comm=false", "model.batch_p2p_comm=true"],
    "pp2_overlap_p2p": [*PP2, *OFF, *OVERLAP_P2P],
    "pp2_all": [*PP2, *PARAM_GATHER, "ddp.align_param_gather=true", *OVERLAP_P2P],
}
"""Setting -> its overrides; each layout's first (``none``, ``pp2_none``) is the one its others are compared to."""
HEADER = f"{'setting':<16} {'layout':<10} {'ms/step':>8} {'tok/s/gpu':>10} {'vs none':>8}"


def layout(name: str) -> str:
    return "pp2" if name.startswith("pp2") else "dp"


def unless_set(defaults: list[str], overrides: list[str]) -> list[str]:
    """``defaults`` whose keys ``overrides`` do not set, then ``overrides``."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return [*(d for d in defaults if d.split("=", 1)[0] not in keys), *overrides]


def row(name: str, r: dict, base: dict | None) -> str:
    if "error" in r:
        return f"{name:<16} {layout(name):<10} failed: {r['error']}"
    ratio = f"{r['tok_s_gpu'] / base['tok_s_gpu']:>8.3f}" if base and "error" not in base else f"{'':>8}"
    return f"{name:<16} {layout(name):<10} {r['step_ms']:>8.1f} {r['tok_s_gpu']:>10,} {ratio}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, required=True, help="processes of every run (GPUs; on a CPU, processes)")
    parser.add_argument("--recipe", default="llama1b")
    parser.add_argument("--iters", type=int, default=20, help="iterations of every run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations at the start of every run")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=None,
                        help="settings to run, in order (default: all; the pp2 ones need an even --gpus)")
    parser.add_argument("overrides", nargs="*", help="bridge overrides (KEY=VALUE) of every run")
    args = parser.parse_args()
    if args.gpus < 2:
        parser.error(f"--gpus {args.gpus}: data-parallel communication needs 2 or more")
    if args.iters <= args.warmup:
        parser.error(f"--iters ({args.iters}) must be more than --warmup ({args.warmup}): the rest are timed")
    names = args.settings or [n for n in SETTINGS if layout(n) == "dp" or args.gpus % 2 == 0]
    if args.gpus % 2 and any(layout(n) == "pp2" for n in names):
        parser.error(f"--gpus {args.gpus}: the pp2 settings need an even number")
    varied = {o.split("=", 1)[0] for n in names for o in SETTINGS[n]}
    clash = [o for o in args.overrides if o.split("=", 1)[0].lstrip("+~") in varied]
    if clash:
        parser.error(f"{' '.join(clash)}: the settings set {'this key' if len(clash) == 1 else 'these keys'}; "
                     "drop the override, or pick --settings that leave it alone")
    import torch

    if not torch.cuda.is_available():
        print(f"no GPU visible: every run takes {args.gpus} process(es) on the CPU (gloo), numbers meaningless",
              flush=True)
    base = [f"recipe={args.recipe}", f"train.train_iters={args.iters}", "logger.log_interval=1",
            "train.eval_iters=0", *with_defaults(unless_set(DEFAULTS, args.overrides), args.iters)]
    warm_file_cache(False)
    results: dict[str, dict] = {}
    print(f"{args.recipe} on {args.gpus} GPU(s), {args.iters} iterations ({args.warmup} untimed)\n{HEADER}", flush=True)
    for name in names:  # each row as its run ends, so a cut-off command still reports
        try:
            results[name] = bridge(args.gpus, [*base, *SETTINGS[name]], args.warmup)
        except RunFailed as failure:  # its command and the end of its output went to stderr
            results[name] = {"error": str(failure)}
        print(row(name, results[name], baseline(name, results)), flush=True)
    print("RESULTS " + json.dumps(results))
    print(f"\n{HEADER}")
    for name, r in results.items():
        print(row(name, r, baseline(name, results)))
    print("(vs none: tokens/s over the same layout's run with no overlap; layouts: dp = DP over every GPU, "
          f"pp2 = PP 2 x VPP 2 x DP {args.gpus // 2})")


def baseline(name: str, results: dict[str, dict]) -> dict | None:
    """The run of ``name``'s layout with no overlap, if it ran."""
    return results.get("pp2_none" if layout(name) == "pp2" else "none")


if __name__ == "__main__":
    sys.exit(main())
