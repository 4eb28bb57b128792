"""`bridge pretrain|finetune checkpoint.pretrained_checkpoint=HF_DIR`: training straight from a Hugging Face folder.

A tiny random fp32 Llama built with transformers is trained from its folder directly (TP=1, and TP=2
under torchrun) and from its `convert-ckpt import-hf` conversion: the losses must agree. The model
section comes from config.json between the recipe and the command line; a command-line field that
contradicts the weights' shape is refused.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, bridge, python, torchrun
from tests.integration.test_pretrain_cpu import losses

transformers = pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("convert_worker.py")
RUN = ["train.train_iters=2", "train.eval_iters=0", "logger.log_interval=1", "train.global_batch_size=4",
       "train.micro_batch_size=2"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """An untied GQA Llama (hidden 64, vocab 512) saved as transformers saves it."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      vocab_size=512, tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(config).float().save_pretrained(folder)
    return folder


def ok(result):
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def imported(hf_dir, tmp_path_factory) -> Path:
    """The folder's `bridge convert-ckpt import-hf` conversion (a checkpoint and its recipe.yaml)."""
    folder = tmp_path_factory.mktemp("imported") / "llama"
    ok(bridge("convert-ckpt", "import-hf", str(hf_dir), str(folder)))
    return folder


@pytest.fixture(scope="module")
def tp2_run(hf_dir, tmp_path_factory) -> tuple[list[float], Path, Path]:
    """`bridge finetune` from the folder at TP=2 (two processes), saving and exporting at the end:
    (its losses, checkpoint.save, checkpoint.export_hf_dir)."""
    work = tmp_path_factory.mktemp("tp2")
    save, export = work / "save", work / "exported"
    result = ok(torchrun(2, "finetune", "recipe=tiny", f"checkpoint.pretrained_checkpoint={hf_dir}",
                         "model.tensor_model_parallel_size=2", *RUN, f"checkpoint.save={save}",
                         f"checkpoint.export_hf_dir={export}", env={"OMP_NUM_THREADS": "1"}))
    assert f"exporting iteration 2 to the Hugging Face folder {export}" in result.stdout
    return losses(result.stdout), save, export


@pytest.mark.slow
def test_training_from_a_hugging_face_folder_equals_training_from_its_import(hf_dir, imported, tp2_run):
    reference = losses(ok(bridge("pretrain", f"recipe={imported / 'recipe.yaml'}", *RUN)).stdout)
    direct = ok(bridge("pretrain", "recipe=tiny", f"checkpoint.pretrained_checkpoint={hf_dir}", *RUN))
    assert "(checkpoint.pretrained_checkpoint; iteration 0): weights only" in direct.stdout
    assert len(reference) == 2
    for curve in (losses(direct.stdout), tp2_run[0]):
        assert curve == pytest.approx(reference, abs=1e-5)
    assert not list(Path(tempfile.gettempdir()).glob("bridge-hf-import-*"))  # the temporary conversion is gone


@pytest.mark.slow
def test_eval_scores_a_hugging_face_folder_as_its_import(hf_dir, imported, tmp_path):
    scores = []
    for args in ([f"recipe={imported / 'recipe.yaml'}", f"checkpoint.load={imported}"],
                 ["recipe=tiny", f"checkpoint.load={hf_dir}"],
                 ["recipe=tiny", f"checkpoint.pretrained_checkpoint={hf_dir}"]):
        output = tmp_path / f"eval{len(scores)}.json"
        ok(bridge("eval", *args, "train.eval_iters=2", "model.seq_length=64", "--output", str(output)))
        scores.append(json.loads(output.read_text())["splits"])
    assert scores[1] == scores[0] == scores[2]


@pytest.mark.slow
def test_export_at_the_end_of_training_reproduces_the_trained_model(hf_dir, tmp_path, tp2_run):
    _, save, export = tp2_run
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, tmp_path / "tokens.pt")
    ok(python(str(WORKER), "--ckpt", f"trained={save}", "--tokens", str(tmp_path / "tokens.pt"),
           "--out", str(tmp_path), env={"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}))
    with torch.no_grad():
        exported = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()(tokens).logits
        original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(tokens).logits
    difference = (exported - torch.load(tmp_path / "trained_tp1.pt")).abs().max().item()
    assert difference < 1e-5, difference  # issue 41's bar for the conversions
    assert (exported - original).abs().max().item() > 1e-3  # it trained


def test_config_json_sets_the_model_between_recipe_and_command_line(cli, hf_dir):
    result = cli("pretrain", "recipe=tiny", f"checkpoint.pretrained_checkpoint={hf_dir}", "model.seq_length=32",
                 "--dry-run")
    assert result.exit_code == 0, result.output
    assert "  hidden_size: 64\n" in result.stdout  # config.json's, not the recipe's 128
    assert "  vocab_size: 512\n" in result.stdout
    assert "  seq_length: 32\n" in result.stdout  # the command line's
    assert "recipe < config.json of checkpoint.pretrained_checkpoint (model) < command-line" in result.stdout


@pytest.mark.parametrize("override, fragment", [
    ("model.hidden_size=128", "model.hidden_size: the command line sets 128; {}/config.json says 64"),
    ("model.seq_length=128", "model.seq_length: 128 is longer than the model supports (64"),
])
def test_a_command_line_field_that_contradicts_the_weights_is_refused(cli, hf_dir, override, fragment):
    result = cli("pretrain", "recipe=tiny", f"checkpoint.pretrained_checkpoint={hf_dir}", override, "--dry-run")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert fragment.format(hf_dir) in result.stderr, result.stderr


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory) -> Path:
    """A Mistral whose sliding window (16) is shorter than max_position_embeddings (64)."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        vocab_size=512, sliding_window=16)
    folder = tmp_path_factory.mktemp("hf") / "mistral"
    transformers.MistralForCausalLM(config).float().save_pretrained(folder)
    return folder


def test_a_sliding_window_model_trains_past_its_window_with_the_window(cli, mistral_dir):
    """model.seq_length above sliding_window keeps the window (the model equals transformers' at every length); the
    command line cannot drop it."""
    result = cli("pretrain", "recipe=tiny", f"checkpoint.pretrained_checkpoint={mistral_dir}", "model.seq_length=64",
                 "--dry-run")
    assert result.exit_code == 0, result.output
    assert "  seq_length: 64\n" in result.stdout and "  window_size:\n  - 15\n  - 0\n" in result.stdout
    refused = cli("pretrain", "recipe=tiny", f"checkpoint.pretrained_checkpoint={mistral_dir}", "model.window_size=null",
                  "--dry-run")
    assert refused.exit_code == 2 and "model.window_size: the command line sets None" in refused.stderr, refused.stderr


@pytest.mark.parametrize("overrides, fragment", [
    (["checkpoint.export_hf_dir={tmp}/out"], "checkpoint.export_hf_dir: needs save set to a directory"),
    (["checkpoint.save={tmp}/save", "checkpoint.export_hf_dir={tmp}/taken"],
     "checkpoint.export_hf_dir: {tmp}/taken already exists and is not an empty folder"),
    (["checkpoint.save={tmp}/save", "checkpoint.export_hf_dir={tmp}/out", "checkpoint.export_hf_model_type=bloom"],
     "checkpoint.export_hf_model_type: 'bloom' is not a family bridge converts"),
])
def test_an_export_that_would_fail_after_training_is_refused_before_it(cli, tmp_path, overrides, fragment):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    result = cli("pretrain", "recipe=tiny", *(o.format(tmp=tmp_path) for o in overrides), "--dry-run")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert fragment.format(tmp=tmp_path) in result.stderr, result.stderr


@pytest.mark.slow
def test_export_at_each_save_writes_one_folder_per_checkpoint(hf_dir, tmp_path):
    export = tmp_path / "exported"
    ok(bridge("pretrain", "recipe=tiny", f"checkpoint.pretrained_checkpoint={hf_dir}", *RUN,
              f"checkpoint.save={tmp_path / 'save'}", "checkpoint.save_interval=1", f"checkpoint.export_hf_dir={export}",
              "checkpoint.export_hf_each_save=true"))
    assert sorted(p.name for p in export.iterdir()) == ["iter_0000001", "iter_0000002"]
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        first, second = (transformers.AutoModelForCausalLM.from_pretrained(export / name, dtype=torch.float32)
                         .eval()(tokens).logits for name in ("iter_0000001", "iter_0000002"))
    assert (first - second).abs().max().item() > 1e-4  # each holds its own iteration's weights


@pytest.mark.slow
def test_a_run_from_a_folder_exports_as_the_folders_family(tmp_path):
    """A Phi-3 folder (fused qkv_proj and gate_up_proj) trained with checkpoint.export_hf_dir comes back as a Phi-3,
    not as the Llama with the same logits that the model alone would give; so does export-hf of its checkpoint."""
    torch.manual_seed(0)
    config = transformers.Phi3Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=64, vocab_size=512,
                                     pad_token_id=None, eos_token_id=2)
    folder, save, export, later = (tmp_path / name for name in ("phi3", "save", "exported", "export_hf"))
    transformers.Phi3ForCausalLM(config).float().save_pretrained(folder)
    ok(bridge("pretrain", "recipe=tiny", f"checkpoint.pretrained_checkpoint={folder}", *RUN, f"checkpoint.save={save}",
              f"checkpoint.export_hf_dir={export}"))
    ok(bridge("convert-ckpt", "export-hf", str(save), str(later)))
    for out in (export, later):
        written = json.loads((out / "config.json").read_text())
        assert (written["model_type"], written["architectures"]) == ("phi3", ["Phi3ForCausalLM"])
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert "model.layers.0.self_attn.qkv_proj.weight" in model.state_dict()


@pytest.mark.slow
def test_lora_on_a_hugging_face_folder_resumes_and_merges(hf_dir, tmp_path):
    save, merged = tmp_path / "adapters", tmp_path / "merged"
    lora = ["recipe=tiny", "peft=lora", f"checkpoint.pretrained_checkpoint={hf_dir}", *RUN, f"checkpoint.save={save}"]
    ok(bridge("finetune", *lora))
    resumed = ok(bridge("finetune", *lora, "train.train_iters=3", "scheduler.override_opt_param_scheduler=true")).stdout
    assert f"converting the Hugging Face folder {hf_dir}" in resumed and "loaded base model" in resumed
    assert "loaded LoRA adapters" in resumed and "iteration 3/3" in resumed
    ok(bridge("peft", "merge", str(save), str(merged), "recipe=tiny", f"checkpoint.pretrained_checkpoint={hf_dir}"))
    assert (merged / "iter_0000003" / "metadata.json").is_file()
