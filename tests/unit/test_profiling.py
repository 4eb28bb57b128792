"""The step profiler's trace lands where the README says, with or without a TensorBoard folder; the GPU time breakdown."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from bridge_cli.config.runtime_configs import ProfilingConfig
from bridge_cli.training import kernel_breakdown
from bridge_cli.training.profiling import StepProfiler


def _profile_steps(profiler: StepProfiler, steps: int) -> None:
    x = torch.randn(64, 64)
    for iteration in range(1, steps + 1):
        profiler.before_step(iteration)
        x = torch.tanh(x @ x)
        profiler.after_step(iteration)
    profiler.close()


def test_trace_without_a_tensorboard_dir_goes_to_torch_profile(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cfg = ProfilingConfig(use_pytorch_profiler=True, profile_step_start=2, profile_step_end=3)
    _profile_steps(StepProfiler(cfg, rank=0, is_cuda=False, trace_dir=None), steps=4)
    assert list((tmp_path / "torch_profile").glob("*.pt.trace.json*"))
    assert "iterations 2..3 written to torch_profile" in capsys.readouterr().out


def test_ranks_not_listed_write_nothing(tmp_path):
    cfg = ProfilingConfig(use_pytorch_profiler=True, profile_step_start=1, profile_step_end=2, profile_ranks=[0])
    _profile_steps(StepProfiler(cfg, rank=1, is_cuda=False, trace_dir=str(tmp_path / "tb")), steps=3)
    assert not (tmp_path / "tb").exists()


def test_kernel_kinds_from_the_names_cublas_cudnn_triton_and_nccl_give():
    names = {
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "GEMM",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "GEMM",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128": "attention",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>": "attention",
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "compiled (Triton)",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)": "communication",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
        "Memcpy DtoD (Device -> Device)": "copies and casts",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": "other kernels",
    }
    assert {name: kernel_breakdown.kind_of(name) for name in names} == names


def test_breakdown_counts_overlapping_kernels_once_for_the_idle_time():
    kernels = [  # two streams: a GEMM overlapped by an all-reduce, a gap of 20 us, then a Triton kernel
        kernel_breakdown.Kernel("nvjet_gemm", 0.0, 100.0),
        kernel_breakdown.Kernel("ncclDevKernel_AllReduce", 50.0, 100.0),
        kernel_breakdown.Kernel("triton_poi_fused_add_0", 170.0, 30.0),
    ]
    shares = {s.kind: s for s in kernel_breakdown.breakdown(kernels, steps=2)}
    assert shares["GEMM"].ms_per_step == pytest.approx(0.05)
    assert shares["communication"].fraction == pytest.approx(0.5)
    assert shares[kernel_breakdown.IDLE].ms_per_step == pytest.approx(0.01)  # 20 us over 2 steps
    assert list(shares)[-1] == kernel_breakdown.IDLE and kernel_breakdown.breakdown([], steps=1) == []


def test_kernels_are_read_back_from_a_chrome_trace(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 10, "dur": 5},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 20, "dur": 1},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 8, "dur": 9}]
    with gzip.open(tmp_path / "t.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert kernel_breakdown.from_trace_file(tmp_path / "t.pt.trace.json.gz") == [
        ("nvjet_gemm", 10.0, 5.0), ("Memcpy HtoD", 20.0, 1.0)]


def test_kernels_are_attributed_to_the_op_that_launched_them(tmp_path):
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9,
               "args": {"External id": 7, "Input Dims": [[4, 8], [8, 2]]}},
              {"ph": "X", "cat": "cpu_op", "name": "aten::add_", "ts": 20, "dur": 2, "args": {"External id": 9}},
              {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 10, "dur": 6, "args": {"External id": 7}},
              {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 30, "dur": 4, "args": {"External id": 7}},
              {"ph": "X", "cat": "kernel", "name": "vectorized_elementwise", "ts": 40, "dur": 2,
               "args": {"External id": 9}},
              {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 50, "dur": 1, "args": {}}]
    with open(tmp_path / "t.pt.trace.json", "w") as f:
        json.dump({"traceEvents": events}, f)
    rows = kernel_breakdown.by_launching_op(tmp_path / "t.pt.trace.json", steps=2, top=2)
    assert rows == [("GEMM", "nvjet_gemm", "aten::mm", "[[4, 8], [8, 2]]", 0.005, 1.0),
                    (kernel_breakdown.OTHER, "vectorized_elementwise", "aten::add_", "", 0.001, 0.5)]
    every = kernel_breakdown.by_launching_op(tmp_path / "t.pt.trace.json", steps=1, top=10)
    assert ("copies and casts", "Memset (Device)", "", "", 0.001, 1.0) in every  # no op in the trace for it
    assert "aten::mm [[4, 8], [8, 2]]" in kernel_breakdown.op_table(rows, "title")


def test_a_cpu_run_prints_no_gpu_breakdown(tmp_path, capsys):
    cfg = ProfilingConfig(use_pytorch_profiler=True, profile_step_start=1, profile_step_end=2)
    _profile_steps(StepProfiler(cfg, rank=0, is_cuda=False, trace_dir=str(tmp_path)), steps=3)
    trace = next(tmp_path.glob("*.pt.trace.json*"))
    assert kernel_breakdown.from_trace_file(trace) == []  # a CPU trace holds no kernels
    assert "by kernel kind" not in capsys.readouterr().out


def test_idle_time_is_split_into_host_late_and_waiting(tmp_path):
    """B is launched after A has finished (the host set the pace: 70 us); C was launched long before B ended and
    still started 100 us late (a wait on another stream or rank)."""
    def launch(correlation, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 10,
                "args": {"correlation": correlation}}

    def kernel(correlation, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": f"k{correlation}", "ts": ts, "dur": dur,
                "args": {"correlation": correlation}}

    events = [launch(1, 0), kernel(1, 20, 80), launch(2, 150), kernel(2, 170, 30), launch(3, 50), kernel(3, 300, 50)]
    trace = tmp_path / "t.pt.trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    late, waiting = kernel_breakdown.idle_causes(trace, steps=1)
    assert (late, waiting) == (pytest.approx(0.070), pytest.approx(0.100))
    assert kernel_breakdown.breakdown(kernel_breakdown.from_trace_file(trace), 1)[-1].ms_per_step == pytest.approx(0.170)
