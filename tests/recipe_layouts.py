"""Layouts the tests give a shipped recipe explicitly, where they test behaviour the recipe's own layout no longer
shows."""

LLAMA8B_DISTRIBUTED_OPTIMIZER = ("dist.use_torch_fsdp2=false", "optimizer.use_distributed_optimizer=true",
                                 "ddp.overlap_grad_reduce=true", "model.gradient_accumulation_fusion=true",
                                 "model.compile_layers=false")
"""llama8b as it shipped before torch FSDP2 (TP=1, megatron-core's DDP with the distributed optimizer), resolved
exactly as then: a layout that fits no count of 80 GB GPUs up to 8 (95.2 GiB on 8), which the memory advisor's
proposals and TP/PP layout tests start from."""
