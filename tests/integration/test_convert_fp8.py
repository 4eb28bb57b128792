"""FP8 block-quantized Hugging Face folders (DeepSeek-V3's release, Qwen3's -FP8 ones): import-hf, and training straight
from such a folder, dequantize them (bridge_cli/convert/fp8_blocks.py).

A tiny random fp32 DeepSeek-V3 and Qwen3 are saved with transformers, then their linear weights quantized here as
the releases are: per 128x128 block, scale = amax / 448, q = (w / scale) in float8_e4m3fn, weight_scale_inv = scale,
and quantization_config added to config.json. The DeepSeek-V3 has sizes that are no multiple of 128 (144, 160, 288:
blocks cut short at the edges) and is saved in two shards with an index, as released (layer 1's scales in the other
shard than its weights); the Qwen3 has sizes of 128 or multiples of it. The imported models must compute what
transformers computes with the dequantized weights (each weight set to q * scale_inv, block by block, by this file),
and the Qwen3 what transformers' own FP8 loader (FineGrainedFP8Config(dequantize=True)) computes.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import bridge
from tests.integration.test_convert_hf import ATOL, MODELS, OWN_SHAPE, SHAPE, logits_at_tp1, ok
from tests.integration.test_pretrain_cpu import losses

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402  (installed with transformers)

BLOCK = 128
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""DeepSeek-V3's quantization_config, as config.json has it."""
QUANTIZED = re.compile(r"^model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")
"""The weights the releases store in FP8: the attention's and MLPs' projections (not the embedding, norms, router or
output head)."""
SHAPES = {
    # q_a_proj 144x160, o_proj 160x96, gate/up 288x160: blocks of 16 and 32 rows or columns at the edges
    "deepseek_v3": {**OWN_SHAPE["deepseek_v3"], "hidden_size": 160, "intermediate_size": 288, "q_lora_rank": 144},
    # q_proj 128x256, k/v 64x256, o_proj 256x128, gate/up 384x256, down 256x384
    "qwen3": {**SHAPE, "hidden_size": 256, "intermediate_size": 384},
}
RUN = ["train.train_iters=2", "train.eval_iters=0", "logger.log_interval=1", "train.global_batch_size=4",
       "train.micro_batch_size=2"]


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 e4m3 weight, weight_scale_inv) of an fp32 matrix, block by block as DeepSeek's release is made."""
    rows, cols = weight.shape
    scale_inv = torch.empty(-(-rows // BLOCK), -(-cols // BLOCK))
    fp8 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            block = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            scale_inv[i, j] = weight[block].abs().max() / 448
            fp8[block] = (weight[block] / scale_inv[i, j]).to(torch.float8_e4m3fn)
    return fp8, scale_inv


def dequantized(fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    weight = fp8.float()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            weight[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] *= scale_inv[i, j]
    return weight


def save_sharded(tensors: dict[str, torch.Tensor], folder: Path, first) -> None:
    """``tensors`` as two safetensors files and their index, in place of ``folder``'s model.safetensors; ``first(key)``
    says which file a tensor goes to."""
    (folder / "model.safetensors").unlink()
    files = {True: "model-00001-of-00002.safetensors", False: "model-00002-of-00002.safetensors"}
    weight_map = {key: files[bool(first(key))] for key in tensors}
    for file in files.values():
        save_file({key: value for key, value in tensors.items() if weight_map[key] == file}, folder / file,
                  metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def logits_of(folder: Path, tokens: torch.Tensor, **options) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **options)
    with torch.no_grad():
        return model.eval()(tokens).logits


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("convert_fp8")


@pytest.fixture(scope="module")
def tokens(work) -> torch.Tensor:
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, work / "tokens.pt")
    return tokens


@pytest.fixture(scope="module")
def folders(work) -> dict[str, dict[str, Path]]:
    """Per family: the model as transformers saved it ("original"), quantized ("fp8"), and the original with each
    quantized weight replaced by its dequantized value ("dequantized", what the FP8 folder means)."""
    out = {}
    for name, shape in SHAPES.items():
        config_cls, model_cls, options, _ = MODELS[name]
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**options, **shape})).float()
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                param.uniform_(0.5, 1.5) if "norm" in param_name else param.normal_(0.0, 0.1)
            for buffer_name, buffer in model.named_buffers():
                if buffer_name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, 0.1)
        paths = {kind: work / f"{name}_{kind}" for kind in ("original", "fp8", "dequantized")}
        model.save_pretrained(paths["original"])
        tensors = load_file(paths["original"] / "model.safetensors")
        fp8, plain = dict(tensors), dict(tensors)
        for key, value in tensors.items():
            if QUANTIZED.match(key):
                fp8[key], fp8[key + "_scale_inv"] = quantize(value)
                plain[key] = dequantized(fp8[key], fp8[key + "_scale_inv"])
        for kind, contents in (("fp8", fp8), ("dequantized", plain)):
            shutil.copytree(paths["original"], paths[kind])
            save_file(contents, paths[kind] / "model.safetensors", metadata={"format": "pt"})
        if name == "deepseek_v3":  # in shards, as released, the scales of layer 1 in the other shard than its weights
            save_sharded(fp8, paths["fp8"], lambda key: key.startswith("model.layers.1.") != key.endswith("_scale_inv"))
        config = json.loads((paths["original"] / "config.json").read_text())
        (paths["fp8"] / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_CONFIG}))
        out[name] = paths
    return out


@pytest.fixture(scope="module")
def imported(work, folders) -> dict[str, Path]:
    out = {}
    for name, paths in folders.items():
        out[name] = work / f"mcore_{name}"
        result = ok(bridge("convert-ckpt", "import-hf", str(paths["fp8"]), str(out[name])))
        count = sum(1 for file in paths["fp8"].glob("*.safetensors") for key in load_file(file)
                    if key.endswith("_scale_inv"))
        assert (f"float32/float8_e4m3fn -> float32; {count} FP8 (e4m3) tensors dequantized from 128x128 blocks"
                in result.stdout), result.stdout
    return out


@pytest.fixture(scope="module")
def mcore_logits(work, imported, tokens) -> dict[str, torch.Tensor]:
    return logits_at_tp1(imported, work / "tokens.pt", work / "logits")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHAPES))
def test_an_fp8_import_computes_what_transformers_computes_with_the_dequantized_weights(name, folders, mcore_logits,
                                                                                        tokens):
    expected = logits_of(folders[name]["dequantized"], tokens)
    difference = (mcore_logits[name] - expected).abs().max().item()
    assert difference < ATOL, f"{name}: {difference:.2e}"
    # FP8 moves the weights far enough that an import of the original (or of the FP8 values unscaled) would fail above
    assert (logits_of(folders[name]["original"], tokens) - expected).abs().max().item() > 1e-2


@pytest.mark.slow
def test_transformers_own_fp8_loader_gives_the_same_logits(folders, mcore_logits, tokens):
    """transformers 5.24's FineGrainedFP8Config(dequantize=True) on the CPU, on the Qwen3, whose sizes are 128 or
    multiples of it. On the DeepSeek-V3 it computes another model: its loader takes the block as the weight's size
    divided by the scale grid's (72x80 for the 144x160 q_a_proj, whose blocks are 128x128 and 16x32 at the edges)."""
    got = logits_of(folders["qwen3"]["fp8"], tokens, quantization_config=transformers.FineGrainedFP8Config(
        dequantize=True))
    difference = (mcore_logits["qwen3"] - got).abs().max().item()
    assert difference < ATOL, f"{difference:.2e}"


@pytest.mark.slow
def test_the_recipe_records_the_dequantization_and_export_writes_the_weights_unquantized(work, folders, imported):
    header = (imported["deepseek_v3"] / "recipe.yaml").read_text().splitlines()[:3]
    assert header[2] == ("# weights: 28 FP8 (e4m3) tensors dequantized from 128x128 blocks with their weight_scale_inv "
                         "(config.json's quantization_config), into model.params_dtype.")
    exported = work / "exported_qwen3"
    ok(bridge("convert-ckpt", "export-hf", str(imported["qwen3"]), str(exported)))
    assert "quantization_config" not in json.loads((exported / "config.json").read_text())
    tensors = load_file(exported / "model.safetensors")
    expected = load_file(folders["qwen3"]["dequantized"] / "model.safetensors")
    assert set(tensors) == set(expected)  # no weight_scale_inv
    for key, value in tensors.items():
        assert value.dtype == torch.float32 and torch.equal(value, expected[key]), key


@pytest.mark.slow
def test_training_from_an_fp8_folder_equals_training_from_its_import(folders, imported):
    reference = losses(ok(bridge("pretrain", f"recipe={imported['qwen3'] / 'recipe.yaml'}", *RUN)).stdout)
    direct = ok(bridge("pretrain", "recipe=tiny", f"checkpoint.pretrained_checkpoint={folders['qwen3']['fp8']}", *RUN))
    assert "its FP8 weights dequantized from their 128x128 block scales" in direct.stdout
    assert len(reference) == 2 and losses(direct.stdout) == pytest.approx(reference, abs=1e-5)


@pytest.fixture
def fp8_copy(tmp_path, folders) -> Path:
    folder = tmp_path / "hf"
    shutil.copytree(folders["qwen3"]["fp8"], folder)
    return folder


def edit_quantization(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], **changes}
    (folder / "config.json").write_text(json.dumps(config))


def edit_tensors(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def drop_config(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))


DOWN = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("damage, fragments", [
    (lambda f: edit_quantization(f, fmt="e5m2"), ["config.json: quantization_config.fmt is 'e5m2'"]),
    (lambda f: edit_quantization(f, quant_method="awq"), ["config.json: quantization_config.quant_method is 'awq'"]),
    (lambda f: edit_quantization(f, activation_scheme="static"),
     ["config.json: quantization_config.activation_scheme is 'static'"]),
    (lambda f: edit_quantization(f, weight_block_size=[64, 64]),
     ["config.json: quantization_config.weight_block_size is [64, 64]"]),
    (lambda f: edit_tensors(f, lambda t: t.pop(DOWN + "_scale_inv")),
     [f"model.safetensors: tensor {DOWN} is stored in FP8 (e4m3) and its scales, tensor {DOWN}_scale_inv, are "
      "missing"]),
    (lambda f: edit_tensors(f, lambda t: t.update({DOWN + "_scale_inv": torch.ones(3, 2)})),
     [f"model.safetensors: tensor {DOWN}_scale_inv has shape (3, 2); the 256x384 FP8 weight {DOWN} in 128x128 "
      "blocks needs (2, 3)"]),
    (lambda f: edit_tensors(f, lambda t: t.update({DOWN + "_scale_inv": t[DOWN + "_scale_inv"].bfloat16()})),
     [f"model.safetensors: tensor {DOWN}_scale_inv is stored as BF16"]),
    (drop_config, ["is stored in FP8 (e4m3)", "config.json has no quantization_config"]),
])
def test_bad_fp8_folders_are_refused_naming_file_and_tensor_and_nothing_is_written(cli, fp8_copy, tmp_path, damage,
                                                                                   fragments):
    damage(fp8_copy)
    out = tmp_path / "out"
    result = cli("convert-ckpt", "import-hf", str(fp8_copy), str(out))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ") and "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    assert not out.exists() and not (tmp_path / "out.incomplete").exists()


def test_training_from_a_folder_of_other_quantization_settings_is_refused_before_it_starts(cli, fp8_copy):
    edit_quantization(fp8_copy, weight_block_size=[128, 64])
    result = cli("pretrain", "recipe=tiny", f"checkpoint.pretrained_checkpoint={fp8_copy}", "--dry-run")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{fp8_copy}/config.json: quantization_config.weight_block_size is [128, 64]" in result.stderr, result.stderr
