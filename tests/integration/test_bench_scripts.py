"""Every script in scripts/bench/ runs here, so that a changed helper or log line breaks a test and not a user.

Each answers --help without importing torch; each that needs a CUDA GPU refuses the CPU with a reason and a
non-zero exit, not a traceback; each with a CPU path makes its smallest real run (slow tier); and the log
parsers the scripts share read a real `bridge pretrain` log. Every script must be in one of the lists below.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, bridge, python, run

BENCH = REPO / "scripts" / "bench"
HELPERS = {"gpu_timing.py", "titan_harness.py"}  # imported by the scripts, not run
GPU_ONLY = {  # each with the arguments of its CPU refusal test
    "adam_step.py": [], "attention_kernels.py": [], "cross_entropy.py": [], "embedding_grad.py": [],
    "fp8_convergence.py": [], "fp8_gemms.py": [], "grouped_wgrad.py": [], "mcore_baseline.py": [],
    # past its argument checks: its --baseline and --titan defaults, the scripts beside it, exist
    "compare_mcore.py": ["--titan"],
}
CPU_RUNS = ["comm_overlap.py", "deepseek_speed.py", "dense_scale.py", "kernel_breakdown.py", "layouts.py",
            "linear_cross_entropy.py", "moe_ep.py", "moe_experts.py", "objective_speed.py", "sft_packing.py"]
"""Each run on the CPU by a test: here, or in test_comm_overlap_bench.py and test_objective_speed.py."""
NOT_RUN = {  # --help only, and why
    "convert_memory.py": "its real run builds a 1.24B-parameter model (8 GB of disk); test_convert_memory.py "
                         "covers its measurement",
    "run_titan.py": "torchtitan is not a dependency: where it is missing the script says so, where it is installed "
                    "a CPU dry run (tested below)",
    "run_titan_moe.py": "the same, and its shape and FLOPs are checked against bridge's moe_proxy below",
    "run_titan_deepseek.py": "the same; its shape, FLOPs and parameter count are checked against bridge's "
                             "deepseek_v3 below, and deepseek_speed.py runs it on the CPU",
}
SCRIPTS = sorted(set(GPU_ONLY) | set(CPU_RUNS) | set(NOT_RUN))
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # as torchrun sets: a run's processes share 2 cores
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal needs a machine without a GPU")


def bench_module(monkeypatch, name: str):
    """scripts/bench/NAME.py imported as its scripts import each other (their folder on sys.path)."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module(name)


def succeeded(result) -> str:
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stdout


def test_every_script_is_tested():
    assert sorted(p.name for p in BENCH.glob("*.py")) == sorted([*SCRIPTS, *HELPERS])


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_answers_without_torch(script):
    result = run(sys.executable, "-X", "importtime", str(BENCH / script), "--help", hand_off=False, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: "), result.stdout
    heavy = re.findall(r"\|\s+(torch|megatron)$", result.stderr, re.M)
    assert not heavy, f"{script} --help imports {sorted(set(heavy))}: import them in main()"


@no_gpu
@pytest.mark.parametrize("script", GPU_ONLY)
def test_gpu_script_refuses_the_cpu_with_a_reason(script):
    result = python(str(BENCH / script), *GPU_ONLY[script], timeout=120)
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"{script} " in result.stderr and "no CUDA GPU is visible here" in result.stderr, result.stderr


def test_compare_mcore_names_a_missing_baseline(tmp_path):
    result = python(str(BENCH / "compare_mcore.py"), "--baseline", str(tmp_path / "none.py"), timeout=60)
    assert result.returncode == 2 and f"no such file: {tmp_path / 'none.py'}" in result.stderr, result.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is not None, reason="torchtitan is installed")
def test_run_titan_without_torchtitan_says_what_to_install():
    result = python(str(BENCH / "run_titan.py"), "--device", "cpu", timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "torchtitan 0.2.2, which is not installed" in result.stderr


TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
no_torchtitan = pytest.mark.skipif(TORCHTITAN, reason="torchtitan is installed")
with_torchtitan = pytest.mark.skipif(not TORCHTITAN, reason="torchtitan 0.2.2 is not installed (run_titan.py's "
                                     "docstring lists its wheels; PYTHONPATH=/tmp/ttsite after pip install --target)")


@no_torchtitan
def test_run_titan_moe_without_torchtitan_says_what_to_install():
    result = python(str(BENCH / "run_titan_moe.py"), "--device", "cpu", timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "run_titan_moe.py runs torchtitan 0.2.2, which is not installed" in result.stderr


@no_torchtitan
def test_moe_ep_titan_without_torchtitan_says_what_to_install():
    """Before any run of bridge's: a comparison that cannot end is not started."""
    result = python(str(BENCH / "moe_ep.py"), "--titan", timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "moe_ep.py --titan runs torchtitan 0.2.2, which is not installed" in result.stderr
    assert result.stdout == ""


def test_run_titan_moe_refuses_an_ep_that_does_not_divide_the_experts():
    result = python(str(BENCH / "run_titan_moe.py"), "--ep", "3", timeout=60)
    assert result.returncode == 2 and "--ep 3 must divide --experts (64) and the number of processes (1)" in \
        result.stderr, result.stderr[-3000:]


@with_torchtitan  # without, it stops earlier (tested above)
def test_moe_ep_titan_refuses_a_shape_qwen3_moe_cannot_take():
    result = python(str(BENCH / "moe_ep.py"), "--titan", "--recipe", "tiny_moe", timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "cannot take the shape of recipe=tiny_moe: model.moe_layer_freq=[0, 1, 1, 1]" in result.stderr


def bridge_moe_proxy(*overrides: str):
    from bridge_cli.config.compose import compose
    from bridge_cli.training.config import ConfigContainer

    cfg = ConfigContainer.from_yaml_dict(compose("moe_proxy", ["model.spec=torch", *overrides]))
    cfg.validate(1, "cuda")
    return cfg


def test_moe_ep_runs_one_gpu_without_the_exchange_fields(monkeypatch):
    """model.moe_exchange_chunks is refused by one process (exit 2), so moe_ep.py's one-GPU runs go without it and
    its EP runs with it."""
    moe_ep = bench_module(monkeypatch, "moe_ep")
    base = ["recipe=moe_proxy", "model.num_layers=8", "model.moe_exchange_chunks=2"]
    assert moe_ep.one_gpu(base) == ["recipe=moe_proxy", "model.num_layers=8"]
    result = bridge("pretrain", *moe_ep.one_gpu(base), "--dry-run", "--device", "cuda")
    assert result.returncode == 0, result.stderr[-2000:]
    refused = bridge("pretrain", *base, "--dry-run", "--device", "cuda")
    assert refused.returncode == 2 and "model.moe_exchange_chunks" in refused.stderr, refused.stderr[-2000:]


def test_moe_ep_sets_each_kernel_kinds_time_per_micro_batch_beside_one_gpus(monkeypatch):
    """The logs as bridge writes them (its start-up line's micro-batches and the profiler's kernel-kind table): one
    GPU's 16 micro-batches a step against EP=4's 4, per micro-batch, the largest increase first; a kind one run lacks
    counts 0 there; no table, no comparison."""
    from bridge_cli.training.kernel_breakdown import Share, table

    moe_ep = bench_module(monkeypatch, "moe_ep")

    def log(micro_batches: int, shares: list) -> str:
        return (f"bridge: cuda (nccl), world 4 = TP 1 x PP 1 x CP 1 x DP 4; GPTModel 8 layers, 1.00M parameters on "
                f"rank 0 (torch spec); 12 iterations x 32 samples x 4096 tokens ({micro_batches} micro-batches of 2)\n"
                + table(shares, "GPU time of iterations 8..10, per iteration, by kernel kind:") + "\n")

    one = moe_ep.kinds_per_micro_batch(log(16, [Share("GEMM", 800.0, 0.6), Share("GPU idle between kernels", 80.0,
                                                                                   0.06)]))
    ep = moe_ep.kinds_per_micro_batch(log(4, [Share("communication", 228.4, 0.41), Share("GEMM", 221.2, 0.39),
                                              Share("GPU idle between kernels", 70.0, 0.125)]))
    assert one == {"GEMM": 50.0, "GPU idle between kernels": 5.0}
    assert ep == pytest.approx({"communication": 57.1, "GEMM": 55.3, "GPU idle between kernels": 17.5})
    lines = moe_ep.kind_comparison("EP=4", one, ep).splitlines()
    assert lines[2].split() == ["communication", "0.00", "57.10", "+57.10"]
    assert lines[3].split()[-1] == "+12.50" and lines[4].split()[-1] == "+5.30"
    assert moe_ep.kind_comparison("EP=4", {}, ep) == ""


def test_moe_ep_reads_how_much_of_the_collectives_ran_beside_compute(monkeypatch, tmp_path):
    """moe_ep.py's trace reading: an all-gather half under one GEMM, a reduce-scatter under two GEMMs that overlap each
    other and under none for its last 10 us, a GEMM alone; two steps."""
    moe_ep = bench_module(monkeypatch, "moe_ep")
    kernels = [("ncclDevKernel_AllGather_RING_LL", 0, 40), ("sm90_xmma_gemm", 20, 60),
               ("ncclDevKernel_ReduceScatter_Sum_bf16", 100, 50), ("nvjet_grouped", 90, 30), ("triton_poi", 110, 30),
               ("triton_red", 200, 20)]
    trace = {"traceEvents": [{"cat": "kernel", "name": name, "ts": ts, "dur": dur} for name, ts, dur in kernels]}
    (tmp_path / "rank0.pt.trace.json").write_text(json.dumps(trace))
    share = moe_ep.collective_share(tmp_path, steps=2)
    assert share["all-gather"] == pytest.approx(0.020) and share["reduce-scatter"] == pytest.approx(0.025)
    assert share[moe_ep.OVERLAPPED] == pytest.approx((20 + 40) / 2 / 1000)
    assert share["GPU time"] == pytest.approx(0.110)


def test_titan_moe_counts_bridges_activated_flops(monkeypatch):
    """moe_ep.py --titan hands torchtitan bridge's shape, and its MFU counts the FLOPs bridge's log counts."""
    from bridge_cli.models.flops import num_floating_point_operations

    moe_ep, run_titan_moe = bench_module(monkeypatch, "moe_ep"), bench_module(monkeypatch, "run_titan_moe")
    flags = moe_ep.titan_shape("moe_proxy", moe_ep.DEFAULT_OVERRIDES)
    assert "--layers=8" in flags and "--local-batch=2" in flags and "--global-batch=32" in flags, flags
    cfg = bridge_moe_proxy(*moe_ep.DEFAULT_OVERRIDES)
    per_token = num_floating_point_operations(cfg.model, 1) / cfg.model.seq_length
    assert run_titan_moe.bridge_flops_per_token(run_titan_moe.parse_args(flags)) == per_token


TITAN_PARAMETERS = """
import sys
import torch
import run_titan_moe, titan_harness
titan_harness.load_moe_kernels_without_triton()
titan_harness.ensure_datasets_importable()
from torchtitan.models.qwen3 import Qwen3Model
with torch.device("meta"):
    model = Qwen3Model(run_titan_moe.model_args(run_titan_moe.parse_args(sys.argv[1:])))
print("PARAMETERS", sum(p.numel() for p in model.parameters()))
"""


@with_torchtitan
def test_titan_moe_model_has_bridges_parameter_count(monkeypatch):
    """torchtitan's Qwen3 MoE built (on the meta device) from the flags moe_ep.py gives it has as many parameters
    as bridge's moe_proxy at the same 2 layers (1.25B: embeddings and 2 x 64 experts)."""
    from bridge_cli.training.memory_estimate import estimate_memory

    moe_ep = bench_module(monkeypatch, "moe_ep")
    flags = moe_ep.titan_shape("moe_proxy", ["model.num_layers=2"])
    result = run(sys.executable, "-c", TITAN_PARAMETERS, *flags, cwd=BENCH, hand_off=False, timeout=300)
    counted = int(re.search(r"^PARAMETERS (\d+)$", succeeded(result), re.M).group(1))
    assert counted == estimate_memory(bridge_moe_proxy("model.num_layers=2"), 1).parameters == 1_247_554_048


@no_torchtitan
def test_dense_scale_titan_without_torchtitan_says_what_to_install():
    """Before any run of bridge's: a comparison that cannot end is not started."""
    result = python(str(BENCH / "dense_scale.py"), "--gpus", "2", "--titan", timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "dense_scale.py --titan runs torchtitan 0.2.2, which is not installed" in result.stderr
    assert result.stdout == ""


def test_dense_scale_hands_torchtitan_llama8bs_shape(monkeypatch):
    """The flags of the hand-made 4-GPU torchtitan run (Llama-3 8B, micro-batch 1, global batch 16), and bridge's
    FLOPs per token of the shape, as bridge's log counts them."""
    from bridge_cli.models.flops import num_floating_point_operations
    from bridge_cli.training.config import ConfigContainer
    from bridge_cli.config.compose import compose

    dense_scale = bench_module(monkeypatch, "dense_scale")
    overrides = dense_scale.with_defaults([], 12)
    assert "train.global_batch_size=16" in overrides and "scheduler.lr_decay_iters=12" in overrides
    assert "train.global_batch_size=32" in dense_scale.with_defaults(["train.global_batch_size=32"], 12)
    assert "train.global_batch_size=16" not in dense_scale.with_defaults(["train.global_batch_size=32"], 12)
    flags, global_batch, seq, per_token = dense_scale.titan_shape("llama8b", overrides)
    assert flags == ["--layers=32", "--hidden=4096", "--heads=32", "--kv-heads=8", "--ffn=14336", "--vocab=128256",
                     "--seq=8192", "--norm-eps=1e-05", "--rope-theta=500000", "--local-batch=1", "--grad-accum=16"]
    cfg = ConfigContainer.from_yaml_dict(compose("llama8b", overrides))
    cfg.validate(4, "cuda")
    assert (global_batch, seq) == (16, 8192)
    assert per_token == num_floating_point_operations(cfg.model, 1) / seq


def test_dense_scale_refuses_a_shape_llama3_cannot_take(monkeypatch, capsys):
    dense_scale = bench_module(monkeypatch, "dense_scale")
    with pytest.raises(SystemExit) as stop:
        dense_scale.titan_shape("tiny", ["model.kv_channels=16"])
    assert stop.value.code == 2
    assert ("dense_scale.py --titan: torchtitan's Llama 3 cannot take the shape of recipe=tiny: "
            "model.share_embeddings_and_output_weights=True (torchtitan's Llama 3: False), model.kv_channels=16 "
            "(torchtitan's Llama 3: hidden_size / num_attention_heads = 32)") in capsys.readouterr().err


def test_a_failed_run_is_named_by_its_error_line(monkeypatch):
    """What a table row shows of a run that failed under torchrun: bridge's own error, else the workers' last
    exception, not torchrun's report of them."""
    compare_mcore = bench_module(monkeypatch, "compare_mcore")
    torchrun_tail = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"x.py\", line 1, in <module>\n"
                     "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB.\n"
                     "Traceback (most recent call last):\n    raise ChildFailedError(\n"
                     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                     "============================================================\n")
    assert compare_mcore.error_line("", torchrun_tail) == \
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB."
    bridge_error = "error: iteration 1: the GPU ran out of memory (CUDA out of memory).\n"
    assert compare_mcore.error_line("iteration ...\n", bridge_error + torchrun_tail) == bridge_error.strip()
    assert compare_mcore.error_line("", "") == "no output"


def test_moe_ep_refuses_too_few_iterations():
    result = python(str(BENCH / "moe_ep.py"), "--iters", "3", timeout=60)
    assert result.returncode == 2 and "--iters must be at least 5" in result.stderr, result.stderr[-3000:]


def test_kernel_breakdown_splits_a_gpu_trace(tmp_path):
    """A profiler trace as CUDA writes it: a GEMM launched by aten::mm and an NCCL all-reduce, over 2 steps."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10,
         "args": {"External id": 7, "Input Dims": [[8, 4], [4, 8]]}},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16", "ts": 100, "dur": 3000,
         "args": {"External id": 7}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16", "ts": 3100, "dur": 1000, "args": {}},
    ]
    trace = tmp_path / "rank0.pt.trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    out = succeeded(python(str(BENCH / "kernel_breakdown.py"), str(trace), "--steps", "2", "--ops", "2", timeout=60))
    assert re.search(r"^  GEMM +1\.5 +75\.0%$", out, re.M), out
    assert re.search(r"^  communication +0\.5 +25\.0%$", out, re.M), out
    assert re.search(r"1\.50 +0  GEMM +sm90_xmma_gemm_bf16bf16 +aten::mm \[\[8, 4\], \[4, 8\]\]", out), out


def test_kernel_breakdown_names_a_missing_trace(tmp_path):
    result = python(str(BENCH / "kernel_breakdown.py"), str(tmp_path / "none.json"), "--steps", "1", timeout=60)
    assert result.returncode == 2 and "no such file" in result.stderr, result.stderr[-3000:]


# --- the log parsers on a real run's log, and the real runs (slow) ---

TINY_LOG = ["recipe=tiny", "train.train_iters=5", "logger.log_interval=1", "train.eval_iters=1",
            "train.eval_interval=0", "logger.timing_log_level=2", "profiling.use_pytorch_profiler=true",
            "profiling.profile_step_start=2", "profiling.profile_step_end=3"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[str, Path]:
    """The stdout of a 5-iteration `bridge pretrain recipe=tiny` with timers and the profiler, and its trace."""
    traces = tmp_path_factory.mktemp("tiny_run")
    out = succeeded(bridge("pretrain", *TINY_LOG, f"logger.tensorboard_dir={traces}", env=ONE_THREAD))
    return out, next(traces.glob("*.pt.trace.json"))


@pytest.mark.slow
def test_log_parsers_read_a_bridge_log(tiny_run, monkeypatch):
    out, _ = tiny_run
    losses = {int(i): float(x) for i, x in re.findall(r"^iteration\s+(\d+)/5 .*\| lm loss ([0-9.]+) ", out, re.M)}
    assert sorted(losses) == [1, 2, 3, 4, 5], out[-3000:]
    compare_mcore, moe_ep, moe_experts, layouts, fp8_convergence = (
        bench_module(monkeypatch, name) for name in ("compare_mcore", "moe_ep", "moe_experts", "layouts",
                                                     "fp8_convergence"))

    assert [int(i) for i, _, _ in compare_mcore.ITER_LINE.findall(out)] == [1, 2, 3, 4, 5]
    assert compare_mcore.START_UP.search(out)
    assert compare_mcore.FIRST_ITERATION.search(next(line for line in out.splitlines() if line.startswith("iter")))

    summary = moe_ep.summary(out)  # iterations 4 and 5 timed
    assert summary["losses"] == losses and math.isnan(summary["ep_load"])  # one process: no expert-parallel load
    spread = "".join(f"iteration {i}/5 | lm loss 1.0 | ep load max/mean {x} | ETA 0:00:01\n"
                     for i, x in ((3, "1.900"), (4, "1.250"), (5, "1.150")))
    assert moe_ep.summary(spread)["ep_load"] == pytest.approx(1.2)  # iterations 4 and 5's, as the others
    assert all(math.isfinite(summary[key]) and summary[key] > 0 for key in ("tokens", "step_ms", "tflops"))
    assert {"forward-backward", "forward-compute", "backward-compute", "optimizer"} <= set(summary["timers"])
    assert moe_ep.curve_difference(losses, summary["losses"], losses) == 0
    assert [int(i) for i, _ in moe_experts.TOKENS.findall(out)] == [1, 2, 3, 4, 5]

    layout = layouts.summarize("1", out, 0)
    assert "failed" not in layout and layout["loss"] == losses and layout["tok_s_gpu"] > 0

    assert [float(x) for _, _, x in fp8_convergence.ITERATION.findall(out)] == list(losses.values())
    assert float(fp8_convergence.VALIDATION.search(out).group(1)) > 0


@pytest.mark.slow
def test_kernel_breakdown_says_a_cpu_trace_has_no_kernels(tiny_run):
    _, trace = tiny_run
    result = python(str(BENCH / "kernel_breakdown.py"), str(trace), "--steps", "2", timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"no GPU kernels in {trace}: a trace of a run on the CPU has none" in result.stderr


@pytest.mark.slow
def test_moe_ep_expert_parallel_curve_on_the_cpu():
    out = succeeded(python(str(BENCH / "moe_ep.py"), "--recipe", "tiny_moe", "--iters", "5", "--ep", "2",
                           "--curves-only", "--", "model.use_cpu_initialization=true", env=ONE_THREAD, timeout=300))
    assert re.search(r"^one GPU +[0-9.]+ +[0-9,]+ ", out, re.M) and re.search(r"^EP=2 on 2 GPUs +[0-9.]+ ", out, re.M)
    assert re.search(r"^EP=2 megatron-core timers .*: forward-backward [0-9.]+", out, re.M), out
    assert len(re.search(r"^EP=2 losses: (.*)$", out, re.M).group(1).split()) == 5
    difference = re.search(r"largest relative difference from one GPU: EP=2 ([0-9.e+-]+)$", out, re.M)
    assert difference and float(difference.group(1)) < 1e-4, out  # fp32 on the CPU: the same curve


@pytest.mark.slow
def test_layouts_on_the_cpu():
    out = succeeded(python(str(BENCH / "layouts.py"), "--recipe", "tiny", "--iters", "4", "--log-interval", "1",
                           "--layouts", "1", "tp2", env=ONE_THREAD, timeout=300))
    assert "no GPU visible: the layouts run one after another on the CPU (gloo)" in out
    results = json.loads(out.split("RESULTS ", 1)[1])
    assert all("failed" not in results[name] for name in ("1", "tp2")), out[-4000:]
    one, tp2 = results["1"]["loss"], results["tp2"]["loss"]
    assert sorted(one) == sorted(tp2) == ["1", "2", "3", "4"]
    assert all(tp2[i] == pytest.approx(one[i], rel=1e-4) for i in one), (one, tp2)


@pytest.mark.slow
def test_sft_packing_on_the_cpu():
    out = succeeded(python(str(BENCH / "sft_packing.py"), "--recipe", "tiny", "--seq", "128", "--records", "64",
                           "--steps", "2", "--warmup", "1", "--global-batch", "4", env=ONE_THREAD, timeout=300))
    per_row = float(re.search(r"([0-9.]+) samples per packed row of 128", out).group(1))
    results = json.loads(out.split("RESULTS ", 1)[1])
    assert per_row > 2 and results["padded"]["samples_s"] > 0
    assert results["packed"]["samples_s"] / results["packed"]["rows_s"] == pytest.approx(per_row, abs=0.005)


@pytest.mark.slow
def test_linear_cross_entropy_on_the_cpu():
    # its CPU setting at a smaller vocabulary and batch: two chunks of 256 tokens
    out = succeeded(python(str(BENCH / "linear_cross_entropy.py"), "model.vocab_size=16384", "model.seq_length=128",
                           "train.micro_batch_size=4", "train.global_batch_size=4", "train.train_iters=3",
                           "model.linear_cross_entropy_chunk=256", env=ONE_THREAD, timeout=300))
    for setting in ("unfused", "fused"):
        assert re.search(rf"^{setting} +[0-9.]+ +[0-9.]+$", out, re.M), out
    assert re.search(r"^fused: -?[0-9.]+ GiB less at its peak, [0-9.]+x the unfused time", out, re.M), out


DENSE_SCALE_ON_THE_CPU = ["--gpus", "2", "--recipe", "tiny", "--iters", "3", "--warmup", "1"]
TINY_UNTIED = ["model.share_embeddings_and_output_weights=false", "train.global_batch_size=8"]


@pytest.mark.slow
def test_dense_scale_on_the_cpu():
    """Two layouts on two processes train the same model to the same loss; Megatron-FSDP, which needs a GPU, is a
    row with bridge's error, and the table goes on. TP=2 runs as a variant without the tp2 layout's distributed
    optimizer, which bridge refuses on the CPU (the layouts themselves: test_dense_scale_layouts_are_what_they_say_on_llama8b)."""
    out = succeeded(python(str(BENCH / "dense_scale.py"), *DENSE_SCALE_ON_THE_CPU, "--layout", "mfsdp",
                           "--variant", "tp2:model.tensor_model_parallel_size=2",
                           "--variant", "fsdp2-dp:dist.use_torch_fsdp2=true,optimizer.use_distributed_optimizer=false,"
                           "ddp.overlap_grad_reduce=false,model.gradient_accumulation_fusion=false", "--", *TINY_UNTIED,
                           env=ONE_THREAD, timeout=600))
    assert re.search(r"^bridge mfsdp +failed: error: ddp.use_megatron_fsdp=true needs a GPU", out, re.M), out
    assert "Traceback" not in out
    results = json.loads(out.split("RESULTS ", 1)[1])
    tp2, fsdp2 = results["bridge tp2"], results["bridge fsdp2-dp"]
    assert tp2["loss"] == pytest.approx(fsdp2["loss"], rel=1e-4), (tp2, fsdp2)
    assert (tp2["layout"], fsdp2["layout"]) == ("world 2 = TP 2 x PP 1 x CP 1 x DP 1",
                                                "world 2 = TP 1 x PP 1 x CP 1 x DP 2")
    for r in (tp2, fsdp2):
        assert r["tok_s_gpu"] > 0 and r["wall_s"] > r["to_first_step_s"] > 0, r
    assert re.search(r"^bridge tp2 +[0-9.]+ +[0-9,]+ .* [0-9.]+$", out, re.M), out
    launch = re.compile(r"^  bridge tp2 \(world 2 = TP 2 x PP 1 x CP 1 x DP 1\): [0-9.]+ s = -?[0-9.]+ torchrun, "
                        r"interpreters \+ [0-9.]+ start-up \(.*imports.*\) \+ [0-9.]+ first iteration$", re.M)
    found = [m.start() for m in launch.finditer(out)]
    # as its run ends (a command cut off later keeps it), and again in the summary after the table
    assert len(found) == 2 and found[0] < out.index("\n\nrun ") < found[1], out


@pytest.mark.parametrize("run", ["bf16", "fp8 tensorwise", "fp8 rowwise"])
def test_fp8_convergence_at_llama8bs_shape_is_a_valid_4_gpu_run(run, monkeypatch, tmp_path):
    """fp8_convergence.py --shape llama8b --gpus 4: each run's overrides pass validation on 4 GPUs (FSDP2, one
    micro-batch of 8 rows each, byte-level vocabulary) and fit 80 GB."""
    fp8_convergence = bench_module(monkeypatch, "fp8_convergence")
    result = bridge("pretrain", *fp8_convergence.shape_overrides("llama8b", 4), f"dataset.blend=[{tmp_path / 'text'}]",
                    *fp8_convergence.RUNS[run], "--dry-run", "--device", "cuda", "--world-size", "4",
                    "--gpu-memory", "80")
    assert result.returncode == 0, result.stderr[-3000:]
    for line in ("micro_batch_size: 8", "hidden_size: 4096", "num_layers: 4", "use_torch_fsdp2: true",
                 "verdict: fits"):
        assert re.search(rf"^\s*{line}$", result.stdout, re.M), (line, result.stdout[-3000:])


@pytest.mark.parametrize("layout, gpu, verdict", [("tp2", 80, "fits"), ("fsdp2", 80, "fits"), ("mfsdp", 80, "fits"),
                                                  ("dp", 80, "will not fit"), ("dpov", 80, "will not fit"),
                                                  ("dpov", 141, "fits")])
def test_dense_scale_layouts_are_what_they_say_on_llama8b(layout, gpu, verdict, monkeypatch):
    """Each layout of dense_scale.py is that layout whatever the recipe ships: on llama8b (which ships torch FSDP2,
    compiled) at the 4-GPU command's global batch the dry run passes validation, and says what the GPUs hold: on
    80 GB the sharded layouts fit, the distributed optimizer over every GPU (dp, dpov) does not: the case only
    Megatron-FSDP and FSDP2 run; on an H200's 141 GB dpov fits (measured there: 89.6 GiB)."""
    dense_scale = bench_module(monkeypatch, "dense_scale")
    result = bridge("pretrain", "recipe=llama8b", "train.global_batch_size=16", *dense_scale.LAYOUTS[layout],
                    "--dry-run", "--device", "cuda", "--world-size", "4", "--gpu-memory", str(gpu))
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(rf"^\s*verdict: {verdict}$", result.stdout, re.M), result.stdout[-3000:]


@pytest.mark.slow
@with_torchtitan
def test_dense_scale_titan_on_the_cpu():
    out = succeeded(python(str(BENCH / "dense_scale.py"), *DENSE_SCALE_ON_THE_CPU, "--layout", "tp2", "--titan",
                           "--titan-arg=--no-compile", "--", *TINY_UNTIED, env=ONE_THREAD, timeout=900))
    assert re.search(r"^torchtitan +[0-9.]+ +[0-9,]+ .* 1\.000 +nan +1\.000 +[0-9.]+$", out, re.M), out
    assert re.search(r"^bridge tp2 +[0-9.]+ +[0-9,]+ .* [0-9.]+ +nan +[0-9.]+ +[0-9.]+$", out, re.M), out
    assert re.search(r"^  torchtitan: [0-9.]+ s = -?[0-9.]+ torchrun, interpreters, imports \+ [0-9.]+ building the "
                     r"Trainer \+ [0-9.]+ first step$", out, re.M), out
    titan = json.loads(out.split("RESULTS ", 1)[1])["torchtitan"]
    assert titan["tok_s_gpu"] > 0 and math.isfinite(titan["loss"]) and titan["to_first_step_s"] > 0, titan


@pytest.mark.slow
@with_torchtitan
def test_dense_scale_names_a_failed_torchtitan_run_and_goes_on():
    """--titan-trainer reaches torchtitan's trainer: a local batch that does not divide the global one stops it under
    torchrun, which the table names by the workers' exception (not torchrun's ChildFailedError); bridge still runs."""
    out = succeeded(python(str(BENCH / "dense_scale.py"), *DENSE_SCALE_ON_THE_CPU, "--layout", "tp2", "--titan",
                           "--titan-arg=--no-compile", "--titan-trainer", "--training.local_batch_size 3", "--",
                           *TINY_UNTIED, env=ONE_THREAD, timeout=900))
    assert re.search(r"^torchtitan +failed: AssertionError: global batch size must be multiple of local batch size",
                     out, re.M), out
    assert re.search(r"^bridge tp2 +[0-9.]+ +[0-9,]+ .* [0-9.]+$", out, re.M) and "Traceback" not in out, out


MOE_PROXY_ON_THE_CPU = [  # moe_proxy at a CPU's size, in fp32
    "mixed_precision=fp32", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
    "model.num_query_groups=2", "model.kv_channels=16", "model.vocab_size=1024", "model.seq_length=128",
    "model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
    "model.gradient_accumulation_fusion=false", "scheduler.lr_warmup_iters=0"]


@pytest.mark.slow
def test_moe_experts_on_the_cpu():
    out = succeeded(python(str(BENCH / "moe_experts.py"), "--layers", "1", "--steps", "1", "--warmup", "1",
                           "--only", "grouped, eager, mbs 1", "--only", "SequentialMLP", "--", *MOE_PROXY_ON_THE_CPU,
                           env=ONE_THREAD, timeout=300))
    for arm in ("grouped, eager, mbs 1", "SequentialMLP"):
        assert re.search(rf"^{re.escape(arm)} +[0-9.]+ ms/step +[0-9,]+ tok/s/gpu", out, re.M), out
    assert re.search(r"^SequentialMLP +tokens/s / SequentialMLP's: 1\.00x$", out, re.M), out


TITAN_MOE_ON_THE_CPU = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                        "--experts", "4", "--topk", "2", "--expert-ffn", "32", "--vocab", "256", "--seq", "32",
                        "--global-batch", "8", "--steps", "2", "--warmup", "1", "--no-compile"]


@pytest.mark.slow
@with_torchtitan
def test_run_titan_on_the_cpu():
    out = succeeded(run(sys.executable, str(BENCH / "run_titan.py"), "--layers", "2", "--hidden", "64", "--heads", "4",
                        "--kv-heads", "2", "--ffn", "128", "--vocab", "256", "--seq", "32", "--local-batch", "2",
                        "--grad-accum", "2", "--steps", "2", "--warmup", "1", env=ONE_THREAD, hand_off=False))
    res = json.loads(out.strip().splitlines()[-1])
    assert res["device"] == "cpu" and res["tokens_per_s"] > 0 and math.isfinite(res["loss_last"]), res


@pytest.mark.slow
@with_torchtitan
def test_run_titan_moe_expert_parallel_on_the_cpu():
    """torchtitan's own EP (all-to-all over gloo) with FSDP2 over both ranks: one JSON line, from rank 0."""
    out = succeeded(run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        str(BENCH / "run_titan_moe.py"), "--ep", "2", *TITAN_MOE_ON_THE_CPU, env=ONE_THREAD,
                        hand_off=False))
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out
    res = json.loads(lines[0])
    assert (res["ep"], res["gpus"], res["fsdp"], res["load_balance"]) == (2, 2, True, "bias"), res
    assert res["tokens_per_s_per_gpu"] > 0 and all(math.isfinite(res[k]) for k in ("loss_first", "loss_last"))
    # 2 x (attention 12,320 with its norms, router 256, experts 24,576, 2 norms) + embeddings, output, final norm
    assert res["params"] == 107_392, res


@pytest.mark.slow
@with_torchtitan
def test_moe_ep_titan_on_the_cpu():
    out = succeeded(python(str(BENCH / "moe_ep.py"), "--recipe", "moe_proxy", "--iters", "5", "--ep", "2",
                           "--curves-only", "--titan", "--titan-arg=--no-compile", "--", *MOE_PROXY_ON_THE_CPU,
                           "model.num_layers=2", "model.use_cpu_initialization=true", "model.compile_layers=false",
                           "train.global_batch_size=8", env=ONE_THREAD, timeout=900))
    assert re.search(r"^torchtitan EP=2 +[0-9.]+ +[0-9,]+ ", out, re.M), out
    assert re.search(r"^EP=2: bridge / torchtitan tokens/s per GPU [0-9.]+x \(bridge [0-9,]+, torchtitan [0-9,]+\)$",
                     out, re.M), out


# deepseek_v3 at a CPU's size on one process, without its MTP layer (torchtitan's DeepSeek-V3 has none)
DEEPSEEK_ON_THE_CPU = [
    "model.spec=torch", "mixed_precision=fp32", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_attention_heads=4", "model.num_query_groups=4", "model.q_lora_rank=32", "model.kv_lora_rank=16",
    "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=16", "model.vocab_size=256",
    "model.seq_length=64", "model.original_max_position_embeddings=64", "model.num_moe_experts=8",
    "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32", "model.moe_shared_expert_intermediate_size=32",
    "model.moe_layer_freq=[0,1]", "model.moe_router_num_groups=2", "model.moe_router_group_topk=1",
    "model.tensor_model_parallel_size=1", "model.sequence_parallel=false", "model.pipeline_model_parallel_size=1",
    "model.num_layers_in_first_pipeline_stage=null", "model.num_layers_in_last_pipeline_stage=null",
    "model.expert_model_parallel_size=1", "model.gradient_accumulation_fusion=false", "model.mtp_num_layers=null",
    "optimizer.use_distributed_optimizer=false", "train.global_batch_size=8", "scheduler.lr_warmup_iters=1",
    "model.use_cpu_initialization=true"]
HAS_DEEPSEEK_PROXY = (REPO / "recipes" / "deepseek_proxy.yaml").is_file()


@no_torchtitan
@pytest.mark.parametrize("script, args", [("deepseek_speed.py", []), ("run_titan_deepseek.py", ["--device", "cpu"])])
def test_deepseek_scripts_without_torchtitan_say_what_to_install(script, args):
    result = python(str(BENCH / script), *args, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"{script} runs torchtitan 0.2.2, which is not installed" in result.stderr


def test_deepseek_speed_refuses_a_shape_torchtitan_cannot_take(monkeypatch, capsys):
    """deepseek_v3 as shipped has an MTP layer; with a shared expert of half an expert and a dense layer after MoE
    ones, each field is named before anything runs."""
    deepseek_speed = bench_module(monkeypatch, "deepseek_speed")
    with pytest.raises(SystemExit) as stop:
        deepseek_speed.titan_shape("deepseek_v3", [*DEEPSEEK_ON_THE_CPU, "model.mtp_num_layers=1",
                                                   "model.moe_shared_expert_intermediate_size=16",
                                                   "model.num_layers=3", "model.moe_layer_freq=[0,1,0]"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "cannot take the shape of recipe=deepseek_v3: model.mtp_num_layers=1 (torchtitan's DeepSeek-V3: no " in err
    assert "model.moe_layer_freq=[0, 1, 0] with model.num_moe_experts=8 (torchtitan's DeepSeek-V3: dense first" in err
    assert "model.moe_shared_expert_intermediate_size=16 (torchtitan's DeepSeek-V3: a whole number of experts" in err


def bridge_deepseek(recipe, overrides):
    from bridge_cli.config.compose import compose
    from bridge_cli.training.config import ConfigContainer

    cfg = ConfigContainer.from_yaml_dict(compose(recipe, overrides))
    cfg.validate(1, "cuda")
    return cfg


DEEPSEEK_SHAPES = [pytest.param("deepseek_v3", DEEPSEEK_ON_THE_CPU, id="deepseek_v3-cpu-size"),
                   pytest.param("deepseek_v3", [*DEEPSEEK_ON_THE_CPU, "model.q_lora_rank=null"], id="no-q-lora"),
                   pytest.param("deepseek_proxy", [], id="deepseek_proxy", marks=pytest.mark.skipif(
                       not HAS_DEEPSEEK_PROXY, reason="recipes/deepseek_proxy.yaml is not written yet"))]


@pytest.mark.parametrize("recipe, overrides", DEEPSEEK_SHAPES)
def test_titan_deepseek_counts_bridges_activated_flops(monkeypatch, recipe, overrides):
    """deepseek_speed.py hands torchtitan bridge's shape, and its MFU counts the FLOPs bridge's log counts
    (multi-latent attention, dense first layers, routed top-k and the shared expert)."""
    from bridge_cli.models.flops import num_floating_point_operations

    deepseek_speed = bench_module(monkeypatch, "deepseek_speed")
    run_titan_deepseek = bench_module(monkeypatch, "run_titan_deepseek")
    flags = deepseek_speed.titan_shape(recipe, overrides)
    cfg = bridge_deepseek(recipe, overrides)
    assert f"--global-batch={cfg.train.global_batch_size}" in flags, flags
    per_token = num_floating_point_operations(cfg.model, 1) / cfg.model.seq_length
    assert run_titan_deepseek.bridge_flops_per_token(run_titan_deepseek.parse_args(flags)) == per_token


TITAN_DEEPSEEK_PARAMETERS = """
import sys
import torch
import run_titan_deepseek, titan_harness
titan_harness.load_moe_kernels_without_triton()
titan_harness.ensure_datasets_importable()
from torchtitan.models.deepseek_v3 import DeepSeekV3Model
args = run_titan_deepseek.model_args(run_titan_deepseek.parse_args(sys.argv[1:]))
args.moe_impl = "standard"  # what its Trainer sets from the job config
with torch.device("meta"):
    model = DeepSeekV3Model(args)
print("PARAMETERS", sum(p.numel() for p in model.parameters()))
"""


@with_torchtitan
@pytest.mark.parametrize("recipe, overrides", DEEPSEEK_SHAPES)
def test_titan_deepseek_model_has_bridges_parameter_count(monkeypatch, recipe, overrides):
    """torchtitan's DeepSeek-V3 built (on the meta device) from deepseek_speed.py's flags has as many parameters as
    bridge's model: the same projections, latent norms, router, experts and shared expert."""
    from bridge_cli.training.memory_estimate import estimate_memory

    flags = bench_module(monkeypatch, "deepseek_speed").titan_shape(recipe, overrides)
    result = run(sys.executable, "-c", TITAN_DEEPSEEK_PARAMETERS, *flags, cwd=BENCH, hand_off=False, timeout=300)
    counted = int(re.search(r"^PARAMETERS (\d+)$", succeeded(result), re.M).group(1))
    assert counted == estimate_memory(bridge_deepseek(recipe, overrides), 1).parameters


@pytest.mark.slow
@with_torchtitan
def test_deepseek_speed_on_the_cpu():
    out = succeeded(python(str(BENCH / "deepseek_speed.py"), "--recipe", "deepseek_v3", "--iters", "6",
                           "--titan-arg=--no-compile", "--", *DEEPSEEK_ON_THE_CPU, env=ONE_THREAD, timeout=900))
    assert re.search(r"^bridge +[0-9.]+ +[0-9,]+ ", out, re.M) and re.search(r"^torchtitan +[0-9.]+ +[0-9,]+ ", out, re.M)
    assert re.search(r"^bridge / torchtitan tokens/s per GPU: [0-9.]+x \(bridge [0-9,]+, torchtitan [0-9,]+\)$",
                     out, re.M), out


@pytest.mark.slow
@with_torchtitan
def test_run_titan_deepseek_on_the_cpu():
    """torchtitan's DeepSeek-V3 with a full-rank query (q_lora_rank 0, as V2-Lite) and no expert groups."""
    out = succeeded(run(sys.executable, str(BENCH / "run_titan_deepseek.py"), "--layers", "2", "--hidden", "64",
                        "--ffn", "128", "--heads", "2", "--q-lora-rank", "0", "--kv-lora-rank", "16",
                        "--qk-head-dim", "16", "--qk-rope-head-dim", "8", "--v-head-dim", "16", "--experts", "4",
                        "--topk", "2", "--groups", "0", "--expert-ffn", "32", "--vocab", "256", "--seq", "32",
                        "--global-batch", "4", "--steps", "2", "--warmup", "1", "--no-compile", env=ONE_THREAD,
                        hand_off=False))
    res = json.loads(out.strip().splitlines()[-1])
    assert res["model"] == "deepseek_v3" and res["device"] == "cpu" and res["tokens_per_s_per_gpu"] > 0, res
    assert all(math.isfinite(res[k]) for k in ("loss_first", "loss_last")), res
