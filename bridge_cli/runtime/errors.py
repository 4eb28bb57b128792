"""Errors raised when the requested run cannot be carried out on this machine."""


class RuntimeUnavailable(Exception):
    """A feature the config asks for cannot run here (e.g. NCCL without a GPU); the message says what to do."""


class OutOfGPUMemory(RuntimeError):
    """A training step did not fit the GPU; the message says what torch tried and which settings free memory."""

    @classmethod
    def during_step(cls, err: BaseException, step: int, train, model) -> "OutOfGPUMemory":
        """From torch's ``OutOfMemoryError`` at ``step``, with the run's ``train`` and ``model`` sections."""
        tried = str(err).split(" Including non-PyTorch memory", 1)[0].strip()  # the sizes, without the advice
        layout = (f"model.tensor_model_parallel_size (now {model.tensor_model_parallel_size}) or "
                  f"model.pipeline_model_parallel_size (now {model.pipeline_model_parallel_size})")
        return cls(f"iteration {step}: the GPU ran out of memory ({tried}). Lower train.micro_batch_size (now "
                   f"{train.micro_batch_size}; train.global_batch_size stays {train.global_batch_size}), set "
                   f"model.recompute_granularity=selective, or split the model over more GPUs with {layout}.")
