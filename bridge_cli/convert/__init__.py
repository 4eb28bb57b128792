"""Hugging Face <-> megatron-core checkpoint conversion (`bridge convert-ckpt`).

``hf_config``   config.json <-> the recipe's ``model:`` section (no torch).
``hf_weights``  tensor names and shapes both ways; the query-group interleave of ``linear_qkv``
                and the gate/up concatenation of ``linear_fc1``.
``hf_files``    reading a Hugging Face folder's safetensors lazily, writing them in shards, and
                the staging folder that makes an output appear all at once.
``mcore_io``    a CPU GPTModel for a model config, loaded from or saved to a torch_dist checkpoint.
``hf_import``   ``import-hf``: HF folder -> torch_dist checkpoint + ``recipe.yaml``.
``hf_export``   ``export-hf``: torch_dist checkpoint -> config.json + safetensors.

Only ``safetensors`` is needed at run time; ``transformers`` is used by the tests alone.
"""
