"""PEFT section: parameter-efficient fine-tuning (LoRA), selected with `peft=lora`."""

from dataclasses import dataclass

from bridge_cli.config.fields import list_field, one_of

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The linear layers of a GPT layer that LoRA can adapt (megatron-core's module names)."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on the transformer's linear layers; the base model stays frozen."""

    target_modules: list[str] = list_field(*LORA_TARGETS)
    """Linear layers to adapt, by megatron-core name: linear_qkv, linear_proj, linear_fc1, linear_fc2."""

    dim: int = 32
    """LoRA rank r: the inner size of the adapter's A (r x in) and B (out x r) matrices."""

    alpha: float = 32
    """Scale numerator: an adapter adds (alpha / dim) * B @ A to its layer's weight."""

    dropout: float = 0.0
    """Dropout on the adapter's input (training only)."""

    lora_A_init_method: str = one_of("xavier", "xavier", "uniform")
    """Init of A: xavier (normal) or uniform (kaiming-uniform, as Hugging Face PEFT); B starts at zero."""

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for each problem; empty when the section is consistent."""
        problems = []
        unknown = [name for name in self.target_modules if name not in LORA_TARGETS]
        if unknown or not self.target_modules:
            problems.append(("target_modules", f"{unknown or 'an empty list'} is not a subset of {list(LORA_TARGETS)}."))
        if self.dim < 1:
            problems.append(("dim", f"must be >= 1, got {self.dim}."))
        if not 0.0 <= self.dropout < 1.0:
            problems.append(("dropout", f"must be in [0, 1), got {self.dropout}."))
        return problems
