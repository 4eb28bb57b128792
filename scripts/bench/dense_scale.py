"""bridge's dense layouts against torchtitan on N GPUs of one host, one run after another in one command.

    python scripts/bench/dense_scale.py --gpus 4 [--recipe llama8b] [--iters 12] [--warmup 4] [--layout NAME ...]
        [--variant NAME:OVERRIDE[,OVERRIDE...] ...] [--titan [PATH]] [--titan-arg FLAG ...] [--titan-trainer FLAGS]
        [-- OVERRIDE ...]

Each ``--layout`` is a `torchrun --nproc-per-node GPUS -m bridge_cli pretrain` of the recipe with the OVERRIDEs and
the layout's own (LAYOUTS below, each whatever the recipe ships: ``shipped`` the recipe as it is, ``tp2`` tensor
parallelism 2 with the distributed optimizer and data parallelism for the rest, ``fsdp2`` eager torch FSDP2 over every
GPU, ``mfsdp`` Megatron-FSDP's optim_grads_params, ``dp`` the distributed optimizer over every GPU with mfsdp's other
settings (Megatron-FSDP's reference where both fit: ``--recipe llama1b --layout dp mfsdp``), ``dpov`` the
distributed optimizer over every GPU with its reduce and gather overlapped, compiled (where the whole weights fit:
llama8b on 4 H200s); default
``tp2 fsdp2``, ``shipped`` on one GPU); each ``--variant NAME:OVERRIDES`` adds one of its own. ``--titan`` first
runs torchtitan 0.2.2 (``run_titan.py`` in this folder) under torchrun on as many GPUs at the recipe's shape
(layers, hidden, heads, KV heads, FFN, vocab, seq, read from bridge's composed config, so the OVERRIDEs count),
micro-batch and global batch, compiled, FSDP2 over the GPUs: its best setting. ``--titan-arg`` passes a flag to
run_titan.py (``--titan-arg=--no-compile``), ``--titan-trainer`` flags to torchtitan's trainer, e.g. its float8
(torchao's wheel too) beside a bridge FP8 variant: ``--titan-trainer "--model.converters quantize.linear.float8
--quantize.linear.float8.recipe_name tensorwise" --variant fp8:mixed_precision=bf16_with_fp8_current_scaling_mixed``.
A field torchtitan's Llama 3 cannot match (tied embeddings, an MoE, ...) stops the script with exit 2 naming it,
before anything runs.

Every bridge run takes DEFAULT_OVERRIDES (global batch 16, the learning rates of the hand-made 4-GPU runs in
docs/performance.md) and ``scheduler.lr_decay_iters=ITERS``, each where the OVERRIDEs do not set its key. bridge's
first ``--warmup`` iterations are not timed; torchtitan runs ``--warmup`` untimed steps and then ``--iters`` timed
ones. So ``--gpus 4 --titan`` makes those hand-made runs (torchtitan, TP=2 x DP=2, FSDP2) as they were typed.

Prints a row per run as it ends, then the table again: ms/step (median after the warm-up), tokens/s/GPU,
TFLOP/s/GPU and MFU by bridge's FLOPs formula for both (bridge_cli/models/flops.py: bridge's log, and the same
formula on the recipe's shape for torchtitan; percent of 989 TFLOP/s, the H100's dense bf16 peak), peak memory
(bridge: its logging rank's; torchtitan: the largest over the ranks), wall time, launch to first step, bridge's
tokens/s, memory and launch time over torchtitan's, and the last loss. A run that fails (out of memory, a layout
the recipe refuses) is a row with its error line; the others go on.

Launch to first step is the same clock for both: seconds from this script starting torchrun to the first step's
log line (bridge's ``iteration 1/``, torchtitan's ``step: 1``), read as it is written, so it counts torchrun,
the interpreters, imports, the model's construction and the whole first step with any compilation in it. A first
process imports the libraries once so that no row pays their cold read from disk. Below the table, where those
seconds went: for bridge its log's start-up line (from its worker's launch, phase by phase) and its first
iteration's time; for torchtitan run_titan.py's init_s (building the Trainer: model, FSDP2, compile wrapping,
optimizer) and first_step_s (its first train_step, compilation included); what remains is torchrun, the
interpreters and the imports before them.

On a machine without a GPU every run goes to the CPU (gloo): a dry run whose numbers mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

from compare_mcore import FIRST_ITERATION, H100_BF16_PEAK_TFLOPS, HEADER, ITER_LINE, START_UP, RunFailed, row
from compare_mcore import run as run_timed
from compare_mcore import warm_file_cache
from layouts import free_port
from moe_ep import summary
from titan_harness import per_gpu_rates, shape_flags

LAYOUTS = {  # each sets what makes it this layout, whatever the recipe ships (llama8b ships torch FSDP2 compiled)
    "shipped": [],
    # the distributed optimizer with its overlapped reduce and fused weight gradients, as Megatron-LM runs TP
    "tp2": ["model.tensor_model_parallel_size=2", "dist.use_torch_fsdp2=false", "optimizer.use_distributed_optimizer=true",
            "ddp.overlap_grad_reduce=true", "model.gradient_accumulation_fusion=true"],
    # eager layers and torch's foreach Adam, the FSDP2 baseline (the shipped llama8b adds compile and the Triton Adam)
    "fsdp2": ["dist.use_torch_fsdp2=true", "optimizer.use_distributed_optimizer=false", "ddp.overlap_grad_reduce=false",
              "model.gradient_accumulation_fusion=false", "model.compile_layers=false", "optimizer.adam_kernel=foreach"],
    # docs/parallelism.md#fsdp: Megatron-FSDP runs eager layers and torch's foreach Adam over its shards; bf16
    # gradients, as FSDP2's (70.2 GiB a GPU for llama8b at 4 GPUs where fp32 ones make 74.4)
    "mfsdp": ["dist.use_torch_fsdp2=false", "optimizer.use_distributed_optimizer=true", "ddp.use_megatron_fsdp=true",
              "ddp.data_parallel_sharding_strategy=optim_grads_params", "ddp.overlap_grad_reduce=false",
              "model.gradient_accumulation_fusion=false", "model.compile_layers=false", "optimizer.adam_kernel=foreach",
              "ddp.grad_reduce_in_fp32=false"],
    # what mfsdp shards, whole on every GPU but the optimizer state (the distributed optimizer over every GPU, no
    # TP), the rest as mfsdp: the layout Megatron-FSDP is measured against where both fit
    "dp": ["dist.use_torch_fsdp2=false", "optimizer.use_distributed_optimizer=true", "ddp.use_megatron_fsdp=false",
           "ddp.overlap_grad_reduce=false", "model.gradient_accumulation_fusion=false", "model.compile_layers=false",
           "optimizer.adam_kernel=foreach", "ddp.grad_reduce_in_fp32=false"],
    # Megatron-LM's way where the whole weights and a bf16 gradient buffer fit beside the activations (llama8b at
    # 4 GPUs: 89.6 GiB, an H200's): the distributed optimizer over every GPU, its gradient reduce-scatter and weight
    # all-gather once a step and overlapped with compute, weight gradients added into main_grad, compiled layers
    "dpov": ["dist.use_torch_fsdp2=false", "optimizer.use_distributed_optimizer=true", "ddp.use_megatron_fsdp=false",
             "ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true", "model.gradient_accumulation_fusion=true",
             "model.compile_layers=true", "optimizer.adam_kernel=foreach", "ddp.grad_reduce_in_fp32=false"],
}
DEFAULT_OVERRIDES = ["train.global_batch_size=16", "optimizer.lr=5e-5", "optimizer.min_lr=5e-6",
                     "scheduler.lr_warmup_iters=2", "scheduler.lr_warmup_fraction=null"]
TITAN_STEP = re.compile(r"step:\s+1\s")  # torchtitan's first step's log line
WORLD = re.compile(r"^bridge: .*?, (world \d+ = [^;]+);", re.M)  # the layout bridge ran, from its start-up lines
# bridge's model fields that run_titan.py takes as they are, and those torchtitan's Llama 3 has fixed
TITAN_FLAGS = {"num_layers": "--layers", "hidden_size": "--hidden", "num_attention_heads": "--heads",
               "num_query_groups": "--kv-heads", "ffn_hidden_size": "--ffn", "vocab_size": "--vocab",
               "seq_length": "--seq", "layernorm_epsilon": "--norm-eps", "rotary_base": "--rope-theta"}
TITAN_FIXED = {"normalization": "RMSNorm", "gated_linear_unit": True, "activation_func": "silu",
               "add_bias_linear": False, "add_qkv_bias": False, "share_embeddings_and_output_weights": False,
               "num_moe_experts": None, "multi_latent_attention": False, "qk_layernorm": False,
               "position_embedding_type": "rope", "rope_scaling": False}


def with_defaults(overrides: list[str], iters: int) -> list[str]:
    """DEFAULT_OVERRIDES and the decay over ``iters``, each unless ``overrides`` set its key, then ``overrides``."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    defaults = [*DEFAULT_OVERRIDES, f"scheduler.lr_decay_iters={iters}"]
    return [*(d for d in defaults if d.split("=", 1)[0] not in keys), *overrides]


def titan_shape(recipe: str, overrides: list[str]) -> tuple[list[str], int, int, float]:
    """run_titan.py's flags for the model and batch of bridge's ``recipe`` with ``overrides`` (exit 2 naming what
    torchtitan's Llama 3 cannot match), the global batch, seq and bridge's FLOPs per token of that shape (the
    vocabulary padded as bridge pads it without tensor parallelism)."""
    from omegaconf import OmegaConf

    from bridge_cli.config.compose import compose
    from bridge_cli.models.flops import num_floating_point_operations

    cfg = compose(recipe, overrides)
    m, train = cfg.model, cfg.train
    head = m.hidden_size // m.num_attention_heads
    unlike = [] if m.kv_channels in (None, head) else [
        f"model.kv_channels={m.kv_channels} (torchtitan's Llama 3: hidden_size / num_attention_heads = {head})"]
    flags = shape_flags("dense_scale.py --titan", "torchtitan's Llama 3", recipe, m, TITAN_FLAGS, TITAN_FIXED, unlike)
    multiple = m.make_vocab_size_divisible_by
    shape = SimpleNamespace(**OmegaConf.to_container(m), padded_vocab_size=-(-m.vocab_size // multiple) * multiple)
    per_token = num_floating_point_operations(shape, 1) / m.seq_length
    flags += [f"--local-batch={train.micro_batch_size}",
              f"--grad-accum={train.global_batch_size // train.micro_batch_size}"]
    return flags, train.global_batch_size, m.seq_length, per_token


def torchrun(gpus: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), "--master-port",
            str(free_port())]


def bridge(gpus: int, overrides: list[str], warmup: int) -> dict:
    """One `bridge pretrain` under torchrun: its speed, memory and loss from its log, and where its launch went."""
    argv = [*torchrun(gpus), "-m", "bridge_cli", "pretrain", *overrides]
    print("$ python " + " ".join(argv[1:]), file=sys.stderr, flush=True)
    out, wall, first = run_timed(argv, FIRST_ITERATION)
    s = summary(out, warmup)
    if not s["losses"]:
        raise RunFailed("no iteration line in its log")
    first_iteration = next((float(ms) / 1000 for i, ms, _ in ITER_LINE.findall(out) if i == "1"), float("nan"))
    start_up, world = START_UP.search(out), WORLD.search(out)
    return {"step_ms": round(s["step_ms"], 1), "tok_s_gpu": round(s["tokens"]), "tflops_gpu": round(s["tflops"], 1),
            "peak_mem_GiB": s["peak"], "loss": s["losses"][max(s["losses"])], "wall_s": wall, "to_first_step_s": first,
            "first_step_s": first_iteration, "start_up": start_up.group(0) if start_up else None,
            "layout": world.group(1) if world else None}


def titan(script: Path, gpus: int, flags: list[str], shape: tuple[int, int, float], a) -> dict:
    """run_titan.py under torchrun: its median step at bridge's FLOPs per token, its memory and loss."""
    argv = [*torchrun(gpus), str(script), *flags, "--compile", "--steps", str(a.iters), "--warmup", str(a.warmup),
            *a.titan_arg, *(["--", *a.titan_trainer.split()] if a.titan_trainer else [])]
    print("$ python " + " ".join(argv[1:]), file=sys.stderr, flush=True)
    out, wall, first = run_timed(argv, TITAN_STEP)
    res = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    global_batch, seq, per_token = shape
    rates = per_gpu_rates(SimpleNamespace(global_batch=global_batch, seq=seq, peak_tflops=H100_BF16_PEAK_TFLOPS),
                          {"step_s_median": res["step_ms_median"] / 1000}, per_token, gpus)
    peak = res["peak_mem_gib"]
    return {"step_ms": res["step_ms_median"], "tok_s_gpu": round(rates["tokens_per_s_per_gpu"]),
            "tflops_gpu": rates["tflops_per_s_per_gpu"], "peak_mem_GiB": float("nan") if peak is None else peak,
            "loss": res["loss_last"], "wall_s": wall, "to_first_step_s": first, "init_s": res["init_s"],
            "first_step_s": res["first_step_s"]}


def launch_line(name: str, r: dict) -> str:
    """Where a run's seconds to its first step went."""
    first = r["to_first_step_s"]
    if "init_s" in r:
        rest = first - r["init_s"] - r["first_step_s"]
        return (f"{name}: {first:.1f} s = {rest:.1f} torchrun, interpreters, imports + {r['init_s']:.1f} building "
                f"the Trainer + {r['first_step_s']:.1f} first step")
    up = re.match(r"start-up ([0-9.]+) s: (.*)", r["start_up"] or "")
    name += f" ({r['layout']})" if r["layout"] else ""
    if not up:
        return f"{name}: {first:.1f} s (no start-up line in its log)"
    rest = first - float(up.group(1)) - r["first_step_s"]
    return (f"{name}: {first:.1f} s = {rest:.1f} torchrun, interpreters + {up.group(1)} start-up ({up.group(2)}) + "
            f"{r['first_step_s']:.1f} first iteration")


def line(name: str, r: dict, base: dict | None) -> str:
    """compare_mcore.py's row, ratios to torchtitan, then the last loss."""
    text = row(name, r, base)
    return text if "error" in r else f"{text:<{len(HEADER)}} {r['loss']:>9.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, required=True, help="processes of every run (GPUs; on a CPU, processes)")
    parser.add_argument("--recipe", default="llama8b")
    parser.add_argument("--iters", type=int, default=12, help="bridge's iterations; torchtitan's timed steps")
    parser.add_argument("--warmup", type=int, default=4, help="untimed iterations (torchtitan's before --iters)")
    parser.add_argument("--layout", nargs="+", choices=sorted(LAYOUTS), default=None,
                        help="bridge layouts to run, in order (default: tp2 fsdp2; on one GPU: shipped)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:OVERRIDES",
                        help="one more bridge run with these comma-separated overrides (repeatable)")
    parser.add_argument("--titan", type=Path, nargs="?", const=Path(__file__).with_name("run_titan.py"),
                        metavar="RUN_TITAN_PY", help="first run torchtitan at the recipe's shape, compiled, FSDP2 "
                        "(default: run_titan.py in this folder)")
    parser.add_argument("--titan-arg", action="append", default=[], metavar="FLAG",
                        help="a flag for run_titan.py (repeatable; needs --titan)")
    parser.add_argument("--titan-trainer", default="", metavar="FLAGS",
                        help="torchtitan trainer flags, one quoted string (needs --titan)")
    parser.add_argument("overrides", nargs="*", help="bridge overrides (KEY=VALUE) of every run, also read for "
                        "torchtitan's shape")
    args = parser.parse_args()
    if args.iters <= args.warmup:
        parser.error(f"--iters ({args.iters}) must be more than --warmup ({args.warmup}): bridge times the rest")
    if (args.titan_arg or args.titan_trainer) and not args.titan:
        parser.error("--titan-arg and --titan-trainer need --titan")
    if args.titan and not args.titan.is_file():
        parser.error(f"no such file: {args.titan}")
    variants = [v.partition(":") for v in args.variant]
    if any(not name or not overrides for name, _, overrides in variants):
        parser.error("--variant takes NAME:OVERRIDE[,OVERRIDE...]")
    if args.titan and importlib.util.find_spec("torchtitan") is None:
        sys.exit("dense_scale.py --titan runs torchtitan 0.2.2, which is not installed here: run_titan.py's docstring "
                 "(--help) lists the wheels it needs.")
    overrides = with_defaults(args.overrides, args.iters)
    titan_flags, *shape = titan_shape(args.recipe, overrides) if args.titan else ([], 0, 0, 0.0)
    import torch

    if not torch.cuda.is_available():
        print(f"no GPU visible: every run takes {args.gpus} process(es) on the CPU (gloo), numbers meaningless",
              flush=True)
    base = [f"recipe={args.recipe}", f"train.train_iters={args.iters}", "logger.log_interval=1",
            "train.eval_iters=0", *overrides]
    runs = {"torchtitan": lambda: titan(args.titan, args.gpus, titan_flags, shape, args)} if args.titan else {}
    for name in args.layout or (["tp2", "fsdp2"] if args.gpus > 1 else ["shipped"]):
        runs[f"bridge {name}"] = lambda o=LAYOUTS[name]: bridge(args.gpus, [*base, *o], args.warmup)
    for name, _, extra in variants:
        runs[f"bridge {name}"] = lambda o=extra.split(","): bridge(args.gpus, [*base, *o], args.warmup)

    header = f"{HEADER} {'last loss':>9}"
    warm_file_cache(bool(args.titan))
    results: dict[str, dict] = {}
    print(f"{args.recipe} on {args.gpus} GPU(s), {args.iters} iterations\n{header}", flush=True)
    for name, measure in runs.items():  # each row and launch as its run ends, so a cut-off command still reports
        try:
            results[name] = measure()
        except RunFailed as failure:  # its command and the end of its output went to stderr
            results[name] = {"error": str(failure)}
        print(line(name, results[name], results.get("torchtitan")), flush=True)
        if "error" not in results[name]:
            print("  " + launch_line(name, results[name]), flush=True)
    print(f"\n{header}")
    for name, r in results.items():
        print(line(name, r, results.get("torchtitan")))
    print("(1st step s: from starting torchrun to the first step's log line; ratios: each run / torchtitan)")
    print("launch to first step, where it went:")
    for name, r in results.items():
        if "error" not in r:
            print("  " + launch_line(name, r))
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
