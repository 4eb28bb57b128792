"""bridge: train GPT/Llama-style models on megatron-core from YAML recipes."""

__version__ = "0.1.0"
