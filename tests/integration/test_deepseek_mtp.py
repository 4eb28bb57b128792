"""DeepSeek-V3's multi-token-prediction layer (issue 43): the Hub's checkpoints hold it as
``model.layers.<num_hidden_layers>`` (enorm, hnorm, eh_proj, a decoder layer, shared_head.norm, and copies of the
embedding and the output head), which transformers' model does not build. import-hf maps it onto megatron-core's MTP
block (``model.mtp_num_layers``), export-hf writes it back.

GLM-4.5 (``glm4_moe``) took the same layer and names; every test here runs for both families. The folder is
test_convert_hf's deepseek_v3 or glm4_moe row (a dense layer, then an MoE layer) with one MTP layer, built as
DeepSeek releases it: the decoder layer of a third, MoE, transformers layer and random MTP tensors. transformers
ignores the MTP layer for the model's logits, so those stay test_convert_hf's; here megatron-core's MTP logits, at
TP=1, TP=2 and EP=2, equal the ones computed by hand from the Hugging Face tensors with transformers' modules (the
equations of megatron-core's MultiTokenPredictionLayer, which DeepSeek-V3's technical report gives), and so do the
MTP losses; the round trip gives the tensors back bitwise.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import REPO, bridge, python
from tests.integration.test_convert_hf import ATOL, MODELS, OWN_SHAPE, SHAPE, WORKER, ok, safetensors_of
from tests.integration.test_pretrain_cpu import losses

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402  (installed with transformers)

LAYERS = 2
"""The decoder's layers; the MTP layer is Hugging Face's layer LAYERS."""
MTP_ONLY = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
FAMILIES_WITH_MTP = ("deepseek_v3", "glm4_moe")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.fixture(scope="module", params=FAMILIES_WITH_MTP)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def work(tmp_path_factory, family) -> Path:
    return tmp_path_factory.mktemp(f"mtp_{family}")


@pytest.fixture(scope="module")
def tokens(work) -> torch.Tensor:
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, work / "tokens.pt")
    return tokens


@pytest.fixture(scope="module")
def hf_mtp(work, tokens, family) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """(the folder, transformers' logits of the model, the MTP layer's logits computed by hand)."""
    config_cls, model_cls, options, _ = MODELS[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**OWN_SHAPE.get(family, SHAPE), "num_hidden_layers": LAYERS + 1},
                                               **options)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    full = work / "hf_three_layers"
    model.save_pretrained(full)
    tensors = safetensors_of(full)
    h, p = config.hidden_size, f"model.layers.{LAYERS}."
    generator = torch.Generator().manual_seed(2)
    tensors.update({p + "enorm.weight": torch.rand(h, generator=generator) + 0.5,
                    p + "hnorm.weight": torch.rand(h, generator=generator) + 0.5,
                    p + "eh_proj.weight": torch.randn(h, 2 * h, generator=generator) * 0.1,
                    p + "shared_head.norm.weight": torch.rand(h, generator=generator) + 0.5,
                    p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                    p + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    folder = work / "hf_mtp"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((full / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**saved, "num_hidden_layers": LAYERS,
                                                    "num_nextn_predict_layers": 1}))

    model.config.num_hidden_layers = LAYERS  # transformers' model runs the first LAYERS layers only
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        logits = model(tokens).logits
        hidden = model.model(tokens).last_hidden_state  # after the final norm, as megatron-core hands it on
        # the next token's embedding at each position (0 past the end, as megatron-core rolls the ids)
        following = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
        eps = config.rms_norm_eps
        x = torch.cat([rms_norm(model.model.embed_tokens(following), tensors[p + "enorm.weight"], eps),
                       rms_norm(hidden, tensors[p + "hnorm.weight"], eps)], dim=-1) @ tensors[p + "eh_proj.weight"].T
        mask = transformers.masking_utils.create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=None,
                                                             cache=None, position_ids=positions)
        x = model.model.layers[LAYERS](x, attention_mask=mask, position_ids=positions,
                                       position_embeddings=model.model.rotary_emb(x, positions))
        mtp = rms_norm(x, tensors[p + "shared_head.norm.weight"], eps) @ tensors[p + "shared_head.head.weight"].T
    assert (mtp - logits).abs().max().item() > 1e-1  # another prediction than the model's
    return folder, logits, mtp


@pytest.fixture(scope="module")
def imported(work, hf_mtp) -> Path:
    out = work / "mcore_mtp"
    ok(bridge("convert-ckpt", "import-hf", str(hf_mtp[0]), str(out)))
    return out


@pytest.fixture(scope="module")
def mcore(work, imported) -> Path:
    """megatron-core's logits and MTP logits of the import at TP=1, TP=2 and EP=2 (one torchrun launch)."""
    out = work / "logits"
    out.mkdir()
    env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    ok(python(str(WORKER), "--ckpt", f"mtp={imported}", "--tokens", str(work / "tokens.pt"), "--out", str(out),
              "--tp", "1", "2", "--ep", "2", "--resave", nproc=2, env=env, timeout=900))
    return out


@pytest.mark.slow
def test_import_maps_the_mtp_layer_onto_megatron_cores_mtp_block(imported):
    model = yaml.safe_load((imported / "recipe.yaml").read_text())["model"]
    assert (model["mtp_num_layers"], model["num_layers"], model["moe_layer_freq"]) == (1, LAYERS, [0, 1])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp1", "tp2", "ep2"])
def test_mtp_logits_and_loss_equal_the_ones_computed_from_the_hugging_face_tensors(layout, hf_mtp, mcore, tokens):
    _, logits, mtp = hf_mtp
    got = torch.load(mcore / f"mtp_{layout}.pt")
    assert (got - logits).abs().max().item() < ATOL  # transformers ignores the MTP layer: the model's are these
    (got_mtp,) = torch.load(mcore / "mtp" / f"mtp_{layout}.pt")
    difference = (got_mtp - mtp).abs().max().item()
    assert difference < ATOL, f"{layout}: {difference:.2e}"
    # the MTP layer predicts the token after next: its loss over the positions that have one
    loss = torch.nn.functional.cross_entropy(mtp[:, :-2].flatten(0, 1), tokens[:, 2:].flatten())
    got_loss = torch.nn.functional.cross_entropy(got_mtp[:, :-2].flatten(0, 1), tokens[:, 2:].flatten())
    assert got_loss.item() == pytest.approx(loss.item(), abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["import", "tp2", "ep2"])
def test_round_trip_gives_the_mtp_layer_back_bitwise(source, work, hf_mtp, imported, mcore):
    """From the import, and from the checkpoint saved again at TP=2 (each tensor in two chunks) or EP=2."""
    out = work / f"roundtrip_{source}"
    ok(bridge("convert-ckpt", "export-hf", str(imported if source == "import" else mcore / f"mtp_{source}_saved"),
              str(out)))
    original, exported = safetensors_of(hf_mtp[0]), safetensors_of(out)
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (LAYERS, 1)


@pytest.mark.slow
def test_an_imported_mtp_layer_trains(imported):
    """megatron-core's MTP block trains from the imported weights: its loss shows on the log line and falls."""
    result = ok(bridge("pretrain", f"recipe={imported / 'recipe.yaml'}", "train.train_iters=6", "train.eval_iters=0",
                       "logger.log_interval=1", "model.seq_length=64"))
    assert len(losses(result.stdout)) == 6
    mtp = [float(line.split("mtp_1 loss ")[1].split()[0])
           for line in result.stdout.splitlines() if "mtp_1 loss" in line]
    assert len(mtp) == 6 and mtp[-1] < mtp[0], mtp


@pytest.mark.parametrize("name", FAMILIES_WITH_MTP)
def test_a_transformers_save_imports_without_mtp(tmp_path, name):
    """transformers' save_pretrained writes num_nextn_predict_layers (1 by default) but no MTP layer: the import has
    none (model.mtp_num_layers null, whatever the base recipe says) rather than refusing a missing tensor."""
    from bridge_cli.convert.families import FAMILIES

    config = {"model_type": name, **OWN_SHAPE.get(name, SHAPE), **MODELS[name][2], "num_nextn_predict_layers": 1}
    config.pop("rope_scaling", None)
    where = tmp_path / "config.json"
    assert FAMILIES[name].model_fields(config, where, tensors=set())["mtp_num_layers"] is None
    with_layer = {f"model.layers.{LAYERS}.eh_proj.weight"}
    assert FAMILIES[name].model_fields(config, where, tensors=with_layer)["mtp_num_layers"] == 1


@pytest.mark.slow
def test_an_mtp_layer_whose_embedding_copy_differs_is_refused(cli, work, hf_mtp, tmp_path):
    """megatron-core's MTP block shares the model's embedding and output head; a copy that differs cannot be held."""
    from safetensors.torch import load_file

    folder = tmp_path / "hf"
    shutil.copytree(hf_mtp[0], folder)
    tensors = load_file(folder / "model.safetensors")
    tensors[f"model.layers.{LAYERS}.shared_head.head.weight"] += 1.0
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    result = cli("convert-ckpt", "import-hf", str(folder), str(tmp_path / "out"))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"tensor model.layers.{LAYERS}.shared_head.head.weight differs from lm_head.weight" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_training_from_the_folder_takes_its_mtp_layer(cli, hf_mtp):
    """checkpoint.pretrained_checkpoint=HF_DIR maps the folder as import-hf does, MTP layer included."""
    result = cli("pretrain", "--dry-run", "recipe=tiny", f"checkpoint.pretrained_checkpoint={hf_mtp[0]}")
    assert result.exit_code == 0, result.output
    assert "  mtp_num_layers: 1\n" in result.stdout
