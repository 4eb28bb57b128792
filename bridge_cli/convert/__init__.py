"""Hugging Face <-> megatron-core checkpoint conversion (`bridge convert-ckpt`).

``families``    one module per Hugging Face family (config mapping + tensor map) and the registry
                import, export and `families` use (no torch).
``hf_config``   reading config.json; the config rules the families share (no torch).
``hf_weights``  the tensor layouts both ways: the query-group interleave of ``linear_qkv`` (from
                separate or fused q/k/v) and the gate/up concatenation of ``linear_fc1``.
``hf_files``    reading a Hugging Face folder's safetensors lazily, writing them in shards, and
                the staging folder that makes an output appear all at once.
``mcore_io``    a CPU GPTModel for a model config, loaded from or saved to a torch_dist checkpoint.
``hf_import``   ``import-hf``: HF folder -> torch_dist checkpoint + ``recipe.yaml``.
``hf_export``   ``export-hf``: torch_dist checkpoint -> config.json + safetensors.
``old_imports`` imports that capped seq_length at a sliding window (before the windows were mapped): a run past
                the window is refused, an export gets the window back.

Only ``safetensors`` is needed at run time; ``transformers`` is used by the tests alone.
"""
