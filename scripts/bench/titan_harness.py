"""What run_titan.py and run_titan_moe.py, in this folder, share: torchtitan 0.2.2's Trainer run as its users run
it, with a model flavor of the caller's, a dummy tokenizer, synthetic tokens, per-step wall clock and one JSON
line of results; and what lets the same code run as a dry run on a CPU (gloo, no triton). Also what the scripts
that run them beside bridge share (shape_flags: bridge's shape as their flags). Not a script.
"""
import argparse
import dataclasses
import importlib.util
import json
import os
import socket
import statistics
import sys
import time


def shape_flags(script, titan_model, recipe, model, flag_of, fixed, unlike=()):
    """The flags of a run_titan*.py script for bridge's composed ``model`` of ``recipe`` (``flag_of``: bridge's model
    field -> the script's flag). Where ``model`` sets a field otherwise than ``titan_model`` has it fixed (``fixed``:
    field -> torchtitan's value), or the caller found more it cannot match (``unlike``), ``script`` stops with exit 2
    naming each one, before anything runs."""
    unlike = [*(f"model.{field}={model.get(field)} ({titan_model}: {value})"
                for field, value in fixed.items() if model.get(field) != value), *unlike]
    if unlike:
        print(f"{script}: {titan_model} cannot take the shape of recipe={recipe}: " + ", ".join(unlike),
              file=sys.stderr)
        sys.exit(2)
    return [f"{flag}={model[field]}" for field, flag in flag_of.items()]


def common_arguments(parser, compile_default=False):
    """The flags every torchtitan mode of this folder takes (run_titan_moe.py adds its shape to them)."""
    p = parser
    p.add_argument("--local-batch", type=int, default=1, help="sequences per micro-batch (training.local_batch_size)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=compile_default,
                   help="torchtitan's compile.enable (components model+loss, backend inductor)")
    p.add_argument("--steps", type=int, default=30, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=10, help="untimed warm-up steps (compile happens here)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="denominator of mfu_h100_bf16_989")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="cpu = dry run of the code path on a machine without a GPU (numbers meaningless)")
    p.add_argument("--dump-folder", default=None, help="torchtitan job.dump_folder (default: a folder under /tmp)")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    p.add_argument("titan_args", nargs="*",
                   help="extra raw torchtitan CLI args after '--', e.g. -- --compile.components model")


def dynamo_stats(torch):
    """Dynamo's counters: unique_graphs should stay small (one block graph + the loss, fwd/bwd),
    and should not grow with the number of steps (that would mean recompiles)."""
    try:
        from torch._dynamo.utils import counters
        return {k: int(v) for k, v in counters["stats"].items()}
    except Exception:
        return None


def setup_single_process_env():
    """Let plain `python3` work: torchtitan reads LOCAL_RANK and calls init_process_group (env://)."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ["MASTER_PORT"] = str(port)
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1"),
                 # This workplace's GPU hosts want NVLink multicast off; harmless on one GPU.
                 ("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        os.environ.setdefault(k, v)


def load_moe_kernels_without_triton():
    """CPU dry run only. torchtitan 0.2.2 imports triton at module level for one MoE kernel
    (models/moe/kernels.py, reached from every model through components/quantization), and a CPU
    machine rarely has triton (a 285 MB wheel). Where it does not import, that one module is loaded
    with a stand-in that only lets its `@triton.jit` definition load (torch itself never sees it); the
    MoE code then runs torchtitan's own CPU version of the kernel (patch_torchtitan_for_cpu)."""
    if importlib.util.find_spec("triton") is not None:
        return
    import builtins
    import types

    triton = types.ModuleType("triton")
    triton.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    triton.language = types.SimpleNamespace(constexpr=object)  # tl.constexpr in annotations
    real_import = builtins.__import__

    def import_without_triton(name, *args, **kw):
        return triton if name.split(".")[0] == "triton" else real_import(name, *args, **kw)

    name = "torchtitan.models.moe.kernels"
    package = importlib.util.find_spec("torchtitan").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(package, "models", "moe", "kernels.py"))
    module = importlib.util.module_from_spec(spec)
    module.__builtins__ = {**vars(builtins), "__import__": import_without_triton}
    spec.loader.exec_module(module)
    sys.modules[name] = module
    print("[run_titan] no triton here: torchtitan's MoE kernels module loaded without it (CPU dry run)",
          file=sys.stderr, flush=True)


def patch_torchtitan_for_cpu(torch):
    """CPU dry run only. torchtitan picks its device with
    torch._utils._get_available_device_type() or "cuda", i.e. "cuda" on a machine without
    a GPU, and its DeviceMemoryMonitor needs torch.cuda memory stats. Point the module-level
    device_type/device_module copies at the CPU and stub the memory monitor. The MoE token
    permutation calls a triton kernel unless told use_cpu=True, and the router an int64 histogram."""
    import functools

    import torchtitan.components.metrics as tt_metrics
    import torchtitan.distributed.dual_pipe_v as tt_dpv
    import torchtitan.distributed.parallel_dims as tt_pd
    import torchtitan.distributed.utils as tt_dist
    import torchtitan.models.moe.kernels as tt_moe_kernels
    import torchtitan.models.moe.utils as tt_moe_utils
    import torchtitan.tools.profiling as tt_prof
    import torchtitan.tools.utils as tt_utils

    for mod in (tt_utils, tt_metrics, tt_dist, tt_pd, tt_prof, tt_dpv):
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = torch.cpu
    tt_moe_utils.generate_permute_indices = functools.partial(tt_moe_kernels.generate_permute_indices, use_cpu=True)
    # The MoE router counts tokens per expert with torch.histc on int64 indices, which CUDA has and the CPU lacks.
    histc = torch.histc

    def histc_of_integers_too(input, bins=100, min=0, max=0):
        if input.is_floating_point():
            return histc(input, bins=bins, min=min, max=max)
        return histc(input.float(), bins=bins, min=min, max=max).to(input.dtype)

    torch.histc = histc_of_integers_too

    class CPUMemoryMonitor:
        device_name = "cpu"
        device_capacity_gib = 0.0

        def get_peak_stats(self):
            return tt_metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self):
            pass

    tt_metrics.build_device_memory_monitor = CPUMemoryMonitor
    # set_pg_timeouts() calls barrier(device_ids=[...]), which gloo rejects; timeouts are moot here.
    tt_dist.set_pg_timeouts = lambda *a, **k: None


def ensure_datasets_importable():
    """torchtitan 0.2.2 imports HF `datasets` unconditionally (llama3/__init__, components/validate),
    although this harness never loads a dataset. If the carried wheel does not import on the
    image, fall back to a stub so the benchmark still runs (said loudly on stderr)."""
    try:
        import datasets  # noqa: F401
        import datasets.distributed  # noqa: F401
        return "real"
    except Exception as e:  # pragma: no cover - only on a broken image
        import types
        print(f"[run_titan] WARNING: `import datasets` failed ({e!r}); using a stub (never used for data)",
              file=sys.stderr, flush=True)
        ds = types.ModuleType("datasets")
        dsd = types.ModuleType("datasets.distributed")

        class Dataset:  # only used in isinstance() checks
            pass

        def _unavailable(*a, **k):
            raise RuntimeError("HF datasets is stubbed out in this benchmark")

        ds.Dataset, ds.load_dataset, ds.distributed = Dataset, _unavailable, dsd
        dsd.split_dataset_by_node = _unavailable
        sys.modules["datasets"], sys.modules["datasets.distributed"] = ds, dsd
        return "stub"


def start(script, a):
    """What every mode does before building a model: refuse without torchtitan, set the process
    environment, pick the device, make torchtitan importable there and send its log to stderr.
    Returns (torch, use_cuda, datasets_mode)."""
    if importlib.util.find_spec("torchtitan") is None:
        sys.exit(f"{script} runs torchtitan 0.2.2, which is not installed here: run_titan.py's docstring "
                 "(--help) lists the wheels it needs.")
    setup_single_process_env()
    import torch

    use_cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        load_moe_kernels_without_triton()
    datasets_mode = ensure_datasets_importable()
    if not use_cuda:
        patch_torchtitan_for_cpu(torch)

    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    for h in logger.handlers:  # keep stdout for the JSON line
        if hasattr(h, "setStream"):
            h.setStream(sys.stderr)
    return torch, use_cuda, datasets_mode


def register_bench_spec(name, base, model_args, a, vocab, use_cuda, **replace):
    """Register torchtitan's TrainSpec ``base`` as ``name`` with one flavor "bench" (``model_args``), a
    dummy tokenizer, synthetic tokens and a metrics processor that keeps every logged row and the
    CUDA peak memory; ``replace`` swaps further TrainSpec fields."""
    import torch
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.protocols.train_spec import register_train_spec

    class DummyTokenizer(BaseTokenizer):
        """No files; only the vocab size matters (no code path uses it with sdpa attention)."""

        def __init__(self, vocab):
            super().__init__()
            self.vocab, self.bos_id, self.eos_id = vocab, 0, vocab - 1

        def encode(self, text, *args, **kwargs):
            return [b % self.vocab for b in str(text).encode()]

        def decode(self, ids, *args, **kwargs):
            return " ".join(str(i) for i in ids)

        def get_vocab_size(self):
            return self.vocab

    class SyntheticTokens(IterableDataset):
        """Endless samples of seq+1 uniform random tokens in [0, vocab); yields the same
        ({"input": x[:-1]}, x[1:]) pairs as torchtitan's HuggingFaceTextDataset."""

        def __init__(self, vocab, seq_len, seed):
            self.vocab, self.seq_len, self.seed, self.n = vocab, seq_len, seed, 0

        def __iter__(self):
            g = torch.Generator().manual_seed(self.seed)
            while True:
                x = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)
                self.n += 1
                yield {"input": x[:-1]}, x[1:]

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    def build_synthetic_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **kw):
        ds = SyntheticTokens(vocab, job_config.training.seq_len, a.seed + dp_rank)
        return ParallelAwareDataloader(
            ds, dp_rank=dp_rank, dp_world_size=dp_world_size,
            **dataclasses.asdict(job_config.training.dataloader),
            batch_size=job_config.training.local_batch_size,
        )

    class BenchMetrics(MetricsProcessor):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.rows, self.peak_alloc, self.peak_reserved = [], 0, 0
            inner, rows = self.logger, self.rows

            class Capture:
                def log(self, metrics, step):
                    rows.append((step, dict(metrics)))
                    inner.log(metrics, step)

                def close(self):
                    inner.close()

            self.logger = Capture()

        def log(self, *args, **kw):
            if use_cuda:  # torchtitan resets the peak stats at the end of every log()
                self.peak_alloc = max(self.peak_alloc, torch.cuda.max_memory_allocated())
                self.peak_reserved = max(self.peak_reserved, torch.cuda.max_memory_reserved())
            super().log(*args, **kw)

    def build_bench_metrics(job_config, parallel_dims, model_args=None, tag=None):
        return BenchMetrics(job_config, parallel_dims, tag)

    register_train_spec(name, dataclasses.replace(
        base,
        model_args={"bench": model_args},
        build_dataloader_fn=build_synthetic_dataloader,
        build_tokenizer_fn=lambda job_config, **kw: DummyTokenizer(vocab),
        build_validator_fn=None,
        build_metrics_processor_fn=build_bench_metrics,
        state_dict_adapter=None,
        **replace,
    ))


def train(a, model_name, global_batch, seq, description, use_cuda, extra=()):
    """torchtitan's Trainer on the registered ``model_name`` flavor "bench", ``a.warmup + a.steps`` steps, each
    train_step timed with a device synchronize at both ends. ``extra`` torchtitan flags go before the user's
    raw ones. Returns (trainer, per-step seconds, construction seconds, the flags)."""
    import torch
    import torchtitan
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import logger
    from torchtitan.train import Trainer

    def sync():
        if use_cuda:
            torch.cuda.synchronize()

    class BenchTrainer(Trainer):
        def __init__(self, job_config):
            self.bench_step_s = []
            super().__init__(job_config)

        def train_step(self, data_iterator):
            sync()
            t0 = time.perf_counter()
            super().train_step(data_iterator)
            sync()
            self.bench_step_s.append(time.perf_counter() - t0)

    dump = a.dump_folder or f"/tmp/titan_bench/{os.getpid()}"
    titan_args = [
        "--job.dump_folder", dump,
        "--job.description", description,
        "--model.name", model_name, "--model.flavor", "bench",
        "--training.local_batch_size", str(a.local_batch),
        "--training.global_batch_size", str(global_batch),
        "--training.seq_len", str(seq),
        "--training.steps", str(a.warmup + a.steps),
        "--training.max_norm", str(a.max_norm),
        "--training.dtype", "float32",                   # fp32 master weights (+ fp32 AdamW states)
        "--training.mixed_precision_param", "bfloat16",  # bf16 compute (AMP autocast on one GPU, else FSDP2's)
        "--optimizer.name", "AdamW", "--optimizer.lr", str(a.lr),
        "--optimizer.weight_decay", str(a.weight_decay),
        "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0.0",  # constant LR
        "--activation_checkpoint.mode", "none",
        "--metrics.log_freq", "1", "--metrics.disable_color_printing",
        "--checkpoint.no-enable",
        "--debug.seed", str(a.seed),
        "--compile.enable" if a.compile else "--compile.no-enable",
        *extra,
    ] + list(a.titan_args)

    config = ConfigManager().parse_args(titan_args)
    logger.info(f"[run_titan] torchtitan {torchtitan.__version__}, args: {' '.join(titan_args)}")
    t_init0 = time.time()
    trainer = BenchTrainer(config)
    t_init = time.time() - t_init0
    if not use_cuda:  # gloo has neither AVG nor PREMUL_SUM: FSDP2 then sums and divides after
        from torch.distributed.fsdp import FSDPModule

        for module in (m for part in trainer.model_parts for m in part.modules() if isinstance(m, FSDPModule)):
            module.set_force_sum_reduction_for_comms(True)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer, trainer.bench_step_s, t_init


def round_or_none(x, n=1):
    return None if x is None else round(float(x), n)


def measurements(a, trainer, step_s, use_cuda):
    """What every mode reports from a finished Trainer: the median step, losses, memory (the largest over the
    ranks), torchtitan's own per-step figures and the run's parameters."""
    import torch

    r = round_or_none
    mp = trainer.metrics_processor
    timed = step_s[a.warmup:]
    assert len(timed) == a.steps, (len(step_s), a.warmup, a.steps)
    by_step = {s: m for s, m in mp.rows}
    losses = [by_step[s]["loss_metrics/global_avg_loss"] for s in sorted(by_step)]
    titan_timed = [by_step[s] for s in sorted(by_step) if s > a.warmup]
    peaks = torch.tensor([float(mp.peak_alloc), float(mp.peak_reserved)], dtype=torch.float64,
                         device="cuda" if use_cuda else "cpu")
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    model = trainer.model_parts[0]
    amp = trainer.maybe_enable_amp
    gib = 2 ** 30
    return {
        "step_s_median": statistics.median(timed),
        "peak_mem_gib": r(peaks[0].item() / gib, 2) if use_cuda else None,
        "loss_first": r(losses[0], 4),
        "loss_last": r(losses[-1], 4),
        "step_ms_median": r(statistics.median(timed) * 1000, 1),
        "step_ms_min": r(min(timed) * 1000, 1),
        "step_ms_max": r(max(timed) * 1000, 1),
        "first_step_s": r(step_s[0], 2),
        "peak_reserved_gib": r(peaks[1].item() / gib, 2) if use_cuda else None,
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries") if use_cuda else None,
        "ooms": torch.cuda.memory_stats().get("num_ooms") if use_cuda else None,
        "titan_tps_median": r(statistics.median(m["throughput(tps)"] for m in titan_timed)),
        "titan_tflops_median": r(statistics.median(m["tflops"] for m in titan_timed), 2),
        "titan_mfu_pct_median": r(statistics.median(m["mfu(%)"] for m in titan_timed), 2),
        "titan_peak_flops": mp.gpu_peak_flops,
        "titan_flops_per_token": mp.num_flops_per_token,
        # FSDP2 shards parameters as DTensors: numel() is the whole parameter's
        "params": sum(p.numel() for p in model.parameters()),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "amp": f"autocast({amp.fast_dtype})" if isinstance(amp, torch.autocast) else "none (FSDP mp policy)",
        "fsdp": trainer.parallel_dims.fsdp_enabled,
        "grad_accum_steps_titan": trainer.gradient_accumulation_steps,
        "warmup": a.warmup, "steps": a.steps,
        "dynamo": dynamo_stats(torch),
        "device": torch.cuda.get_device_name() if use_cuda else "cpu",
        "torch": torch.__version__,
    }


def per_gpu_rates(a, m, flops_per_token, world):
    """tokens/s, TFLOP/s (``flops_per_token``: bridge's formula) and MFU per GPU of a run of ``a.global_batch``
    sequences a step, from ``measurements()``'s median step, which it takes out of ``m``."""
    tokens = a.global_batch * a.seq / m.pop("step_s_median") / world
    tflops = flops_per_token * tokens / 1e12
    return {"tokens_per_s_per_gpu": round_or_none(tokens), "tflops_per_s_per_gpu": round_or_none(tflops, 2),
            "mfu_pct": round_or_none(100 * tflops / a.peak_tflops, 2)}  # activated FLOPs, percent of --peak-tflops


def report(a, model, trainer, step_s, use_cuda, flops_per_token, datasets_mode, t_init, t_start, **fields):
    """Measure a bench runner's finished Trainer and emit its JSON: the keys every runner writes (torchtitan's
    version, the batch, ``per_gpu_rates`` by bridge's ``flops_per_token``, ``measurements``), then ``fields`` (the
    runner's own settings and shape), then the data and timing."""
    import torchtitan

    world = int(os.environ["WORLD_SIZE"])
    m = measurements(a, trainer, step_s, use_cuda)
    rates = per_gpu_rates(a, m, flops_per_token, world)
    emit({
        "trainer": "torchtitan",
        "model": model,
        "version": torchtitan.__version__,
        "compile": a.compile,
        "gpus": world,
        "mbs": a.local_batch,
        "gbs": a.global_batch,
        **rates,
        **m,
        "flops_per_token": flops_per_token,
        **fields,
        "datasets": datasets_mode,
        "init_s": round_or_none(t_init, 2),
        "total_s": round_or_none(time.time() - t_start, 1),
    }, a.json_out)


def emit(res, json_out):
    """Rank 0 prints the JSON line as the last line of stdout (and writes it to ``json_out``); then the
    process group ends."""
    import torch

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if rank:
        return
    line = json.dumps(res)
    if json_out:
        with open(json_out, "w") as f:
            f.write(line + "\n")
    sys.stderr.flush()
    print(line, flush=True)
