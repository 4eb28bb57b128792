"""Errors raised when the requested run cannot be carried out on this machine."""


class RuntimeUnavailable(Exception):
    """A feature the config asks for cannot run here (e.g. NCCL without a GPU); the message says what to do."""


class OutOfGPUMemory(RuntimeError):
    """The model, its optimizer or a training step did not fit the GPU; the message says what torch tried and
    which settings free memory."""

    @classmethod
    def during_step(cls, err: BaseException, step: int, train, model, optimizer) -> "OutOfGPUMemory":
        """From torch's ``OutOfMemoryError`` at ``step``, with the run's ``train``, ``model`` and ``optimizer``."""
        smaller = (f"Lower train.micro_batch_size (now {train.micro_batch_size}; train.global_batch_size stays "
                   f"{train.global_batch_size}), set" if train.micro_batch_size > 1 else "Set")
        # full recompute: selective recompute of the core attention saves little where flash attention keeps no scores
        return cls(f"iteration {step}: the GPU ran out of memory ({_tried(err)}). {smaller} "
                   f"model.recompute_granularity=full model.recompute_method=uniform model.recompute_num_layers=1, "
                   f"{_sharding(optimizer)}or split the model over more GPUs with {_layout(model)}. The same command "
                   "with --dry-run --device cuda estimates the memory of each setting.")

    @classmethod
    def during_setup(cls, err: BaseException, model, optimizer) -> "OutOfGPUMemory":
        """From torch's ``OutOfMemoryError`` while the model, its optimizer or a checkpoint was put on the GPU."""
        sharding = _sharding(optimizer)
        return cls(f"the model and its optimizer state do not fit the GPU ({_tried(err)}): "
                   f"{sharding + 'or ' if sharding else ''}split the model over more GPUs with {_layout(model)}.")


def _tried(err: BaseException) -> str:
    """torch's out-of-memory message without its advice: what it tried to allocate and what was free."""
    return str(err).split(" Including non-PyTorch memory", 1)[0].strip()


def _sharding(optimizer) -> str:
    return ("" if optimizer.use_distributed_optimizer else
            "set optimizer.use_distributed_optimizer=true (the optimizer state sharded over data-parallel ranks), ")


def _layout(model) -> str:
    return (f"model.tensor_model_parallel_size (now {model.tensor_model_parallel_size}) or "
            f"model.pipeline_model_parallel_size (now {model.pipeline_model_parallel_size})")
