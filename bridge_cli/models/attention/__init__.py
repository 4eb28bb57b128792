"""Core attention of the ``torch`` layer spec, without Transformer Engine.

``core``          the module megatron-core's ``SelfAttention`` calls: causal SDPA, or masked attention
``masks``         which keys each query sees: documents, sliding windows; built once per batch
``kernels``       the masked kernels: FlexAttention on the GPU, an explicit mask on the CPU
``context_parallel``  context parallelism without Transformer Engine: rows cut over ranks, keys gathered
``config_checks``  the config rules of all of the above
``sdpa_backend``  ``model.sdpa_backend``: pinning the causal path to one SDPA kernel
"""
