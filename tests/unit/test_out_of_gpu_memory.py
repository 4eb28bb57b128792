"""What a run that does not fit the GPU prints: torch's sizes without its advice, then the settings that free
memory, each with its current value, and none that cannot help (the end-to-end runs: tests/gpu/test_gpu_features.py)."""

from __future__ import annotations

from types import SimpleNamespace

from bridge_cli.runtime.errors import OutOfGPUMemory

TORCH = ("CUDA out of memory. Tried to allocate 448.00 MiB. GPU 0 has a total capacity of 79.18 GiB of which 144.19 "
         "MiB is free. Including non-PyTorch memory, this process has 79.03 GiB memory in use. Of the allocated ...")
MODEL = SimpleNamespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)


def test_a_step_names_the_micro_batch_recompute_sharding_and_layout():
    message = str(OutOfGPUMemory.during_step(RuntimeError(TORCH), 7, SimpleNamespace(micro_batch_size=4,
                  global_batch_size=32), MODEL, SimpleNamespace(use_distributed_optimizer=False)))
    assert message.startswith("iteration 7: the GPU ran out of memory (CUDA out of memory. Tried to allocate 448.00 "
                              "MiB. GPU 0 has a total capacity of 79.18 GiB of which 144.19 MiB is free.).")
    assert "Including non-PyTorch" not in message
    for fragment in ("train.micro_batch_size (now 4; train.global_batch_size stays 32)",
                     "model.recompute_granularity=full", "optimizer.use_distributed_optimizer=true",
                     "--dry-run --device cuda",
                     "model.tensor_model_parallel_size (now 2)", "model.pipeline_model_parallel_size (now 1)"):
        assert fragment in message


def test_what_is_already_as_small_as_it_goes_is_not_offered():
    message = str(OutOfGPUMemory.during_step(RuntimeError(TORCH), 1, SimpleNamespace(micro_batch_size=1,
                  global_batch_size=8), MODEL, SimpleNamespace(use_distributed_optimizer=True)))
    assert "micro_batch_size" not in message and "use_distributed_optimizer" not in message
    assert ("Set model.recompute_granularity=full model.recompute_method=uniform model.recompute_num_layers=1, "
            "or split the model") in message


def test_the_set_up_names_sharding_and_layout():
    message = str(OutOfGPUMemory.during_setup(RuntimeError(TORCH), MODEL, SimpleNamespace(use_distributed_optimizer=False)))
    assert message.startswith("the model and its optimizer state do not fit the GPU (CUDA out of memory.")
    assert "set optimizer.use_distributed_optimizer=true (the optimizer state sharded over data-parallel ranks), or " \
           "split the model over more GPUs with model.tensor_model_parallel_size (now 2)" in message
