"""`bridge peft export-hf`: a LoRA run's adapters as a Hugging Face PEFT folder.

Tiny random fp32 models built with transformers (a GQA Llama; a Phi-3, whose fused qkv_proj and gate_up_proj
take the fused projections' adapters whole; a GPT-2, whose Conv1Ds store their weights transposed; a Mixtral, its
adapters on attention only) are imported, their adapters trained for a few steps, and exported: `peft` loads them
onto the base's export-hf, and the logits equal bridge's LoRA model's and those of the merged checkpoint's export
(1e-5). A checkpoint without adapters, and adapters on routed experts, are refused before anything is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import bridge, python

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

SHAPE = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, vocab_size=512, tie_word_embeddings=False)
MOE = {**SHAPE, "num_local_experts": 4, "num_experts_per_tok": 2}
# transformers' class names, looked up as a test runs: the classes themselves would import four families' model
# code into every worker's collection, the fast tier's too (0.9 s)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", SHAPE),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**SHAPE, "pad_token_id": 0, "sliding_window": 8}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=512)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", MOE),
}
TARGETS = {
    "llama": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
    "phi3": ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"],
    "gpt2": ["c_attn", "c_fc", "c_proj"],
    "mixtral": ["k_proj", "o_proj", "q_proj", "v_proj"],
}
ATTENTION_ONLY = "peft.target_modules=[linear_qkv,linear_proj]"
ADAPTERS = ["peft=lora", "peft.dim=4", "peft.alpha=8"]
LORA = [*ADAPTERS, "train.train_iters=3", "train.eval_iters=0", "train.global_batch_size=4",
        "train.micro_batch_size=2", "optimizer.lr=0.01"]
WORKER = Path(__file__).with_name("peft_export_worker.py")


def ok(result):
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def imported(name: str, work: Path) -> str:
    """A random fp32 model of the family ``name``, saved by transformers and imported; its recipe."""
    config, model, fields = MODELS[name]
    torch.manual_seed(0)
    getattr(transformers, model)(getattr(transformers, config)(**fields)).float().save_pretrained(work / "hf")
    ok(bridge("convert-ckpt", "import-hf", str(work / "hf"), str(work / "imported")))
    return str(work / "imported" / "recipe.yaml")


@pytest.fixture(scope="module", params=list(MODELS))
def exported(request, tmp_path_factory):
    """A family's folders: (its name, the base's export-hf, the adapters' PEFT folder, the merged model's
    export-hf, bridge's LoRA logits for the tokens, the tokens)."""
    name = request.param
    work = tmp_path_factory.mktemp(name)
    recipe = imported(name, work)
    adapters = [*ADAPTERS, *([ATTENTION_ONLY] if name == "mixtral" else [])]
    ok(bridge("pretrain", f"recipe={recipe}", *LORA, *adapters[len(ADAPTERS):], f"checkpoint.save={work / 'lora'}"))
    ok(bridge("peft", "export-hf", str(work / "lora"), str(work / "peft")))
    ok(bridge("convert-ckpt", "export-hf", str(work / "imported"), str(work / "base_hf")))
    ok(bridge("peft", "merge", str(work / "lora"), str(work / "merged"), f"recipe={recipe}"))
    ok(bridge("convert-ckpt", "export-hf", str(work / "merged"), str(work / "merged_hf")))
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, work / "tokens.pt")
    ok(python(str(WORKER), recipe, str(work / "lora"), str(work / "tokens.pt"), str(work / "bridge_logits.pt"),
                  *adapters))
    return name, work / "base_hf", work / "peft", work / "merged_hf", torch.load(work / "bridge_logits.pt"), tokens


def hf_logits(model, tokens):
    with torch.no_grad():
        return model.eval()(tokens).logits.float()


def test_peft_loads_the_adapters_onto_the_exported_base_with_bridges_logits(exported):
    peft = pytest.importorskip("peft")  # not at the top: every worker collects this module, the fast tier's too (1 s)
    name, base_dir, peft_dir, merged_dir, bridge_logits, tokens = exported
    assert sorted(p.name for p in peft_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["lora_dropout"]) == ("LORA", 4, 8, 0)
    assert config["target_modules"] == TARGETS[name]
    assert config["fan_in_fan_out"] == (name == "gpt2")
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    plain = hf_logits(base, tokens)
    adapted = peft.PeftModel.from_pretrained(base, peft_dir)
    with_adapters = hf_logits(adapted, tokens)
    merged = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32), tokens)
    assert (with_adapters - plain).abs().max().item() > 1e-3  # the adapters trained away from zero
    assert (with_adapters - bridge_logits).abs().max().item() < 1e-5
    assert (with_adapters - merged).abs().max().item() < 1e-5
    # every module peft adapted got its trained A and B from the file (none left at peft's initialisation)
    lora_modules = [m for m in adapted.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(lora_modules) == 2 * len(TARGETS[name]) + (name == "gpt2") * 2  # gpt2: attn.c_proj and mlp.c_proj
    assert all(m.lora_B["default"].weight.abs().max() > 0 for m in lora_modules)


def test_a_checkpoint_without_adapters_or_with_adapters_on_experts_is_refused_writing_nothing(tmp_path):
    recipe = imported("mixtral", tmp_path)
    whole = bridge("peft", "export-hf", str(tmp_path / "imported"), str(tmp_path / "out"))
    assert whole.returncode == 2 and whole.stderr.count("\n") == 1, whole.stderr
    assert "holds a whole model, not LoRA adapters" in whole.stderr and "bridge convert-ckpt export-hf" in whole.stderr
    ok(bridge("pretrain", f"recipe={recipe}", *LORA, "train.train_iters=1", f"checkpoint.save={tmp_path / 'lora'}"))
    experts = bridge("peft", "export-hf", str(tmp_path / "lora"), str(tmp_path / "out"))
    assert experts.returncode == 2 and experts.stderr.count("\n") == 1, experts.stderr
    assert "include the routed experts' linear_fc1/linear_fc2" in experts.stderr
    assert "stacked parameters" in experts.stderr and "bridge peft merge" in experts.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.incomplete").exists()
