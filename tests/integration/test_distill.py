"""`bridge finetune finetune.objective=distill` (recipe tiny_distill) end to end on the CPU: the KL to the teacher
falls, `bridge eval` reports it, the teacher stays frozen, TP=2 and DP=2 give one process's curve, a resumed run
prints the uninterrupted one's, a Hugging Face teacher gives the bridge checkpoint's numbers, LoRA and packed rows
train, bad input exits 2.

The teacher is the shared tiny base (2 layers, hidden 128); the student is tiny_distill's (1 layer, hidden 64)."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import bridge, python, torchrun
from tests.integration.sft_setup import pretrained_base, write_sft_data

pytestmark = pytest.mark.slow

LINE = re.compile(r"^iteration\s+(\d+)/\d+ .*\| distill loss (\S+) \| kl loss (\S+) \| lm loss (\S+) \| .*"
                  r"\| grad norm (\S+) ", re.M)
SHORT = ["train.train_iters=6", "logger.log_interval=1", "train.eval_iters=0"]


def curve(output: str) -> dict[int, tuple[str, ...]]:
    """iteration -> (distill loss, kl loss, lm loss, grad norm) as printed."""
    return {int(m[0]): m[1:] for m in LINE.findall(output)}


def numbers(steps: dict[int, tuple[str, ...]]) -> dict[int, tuple[float, ...]]:
    return {step: tuple(float(x) for x in values) for step, values in steps.items()}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return pretrained_base(tmp_path_factory.getbasetemp())[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_sft_data(tmp_path_factory.mktemp("distill_data"))


def distill(teacher, data, *args):
    return ["finetune", "recipe=tiny_distill", f"distill.teacher_checkpoint={teacher}", f"dataset.dataset_root={data}",
            *args]


@pytest.fixture(scope="module")
def tiny_distill_run(teacher, data, tmp_path_factory):
    save = tmp_path_factory.mktemp("distill") / "ckpt"
    result = bridge(*distill(teacher, data, "train.train_iters=20", "train.eval_interval=10", "logger.log_interval=5",
                             f"checkpoint.save={save}", "checkpoint.save_interval=10"))
    assert result.returncode == 0, result.stderr[-3000:]
    return save, result.stdout


def test_tiny_distill_lowers_the_kl_and_logs_both_losses(teacher, tiny_distill_run):
    stdout = tiny_distill_run[1]
    assert f"distillation teacher: {teacher} (2 layers, hidden 128), frozen" in stdout
    assert "GPTModel 1 layers" in stdout
    steps = numbers(curve(stdout))
    assert sorted(steps) == [5, 10, 15, 20]
    assert steps[20][1] < 0.8 * steps[5][1], steps
    for total, kl, ce, _ in steps.values():  # the recipe: T = 2, ce_weight = 0.1
        assert total == pytest.approx(0.9 * 4 * kl + 0.1 * ce, abs=1e-5)
    validation = re.search(r"^validation at the end of training \(iteration 20\) \| (.*)$", stdout, re.M).group(1)
    assert re.fullmatch(r"distill loss [0-9.]+ \| kl loss [0-9.]+ \| lm loss [0-9.]+ \| lm loss PPL [0-9.]+",
                        validation), validation  # a perplexity for the cross entropy only


def test_eval_reports_the_kl_to_the_teacher(teacher, data, tiny_distill_run, tmp_path):
    """bridge eval scores a checkpoint on the batches a run's first validation reads: the checkpoint saved at
    iteration 10 gives the numbers the validation at iteration 10 logged."""
    save, stdout = tiny_distill_run
    first = re.search(r"^validation at iteration 10 \| (.*)$", stdout, re.M).group(1)
    logged = {key: float(value) for key, value in (field.rsplit(" ", 1) for field in first.split(" | "))}
    output = tmp_path / "eval.json"
    result = bridge("eval", "recipe=tiny_distill", f"checkpoint.load={save}", "checkpoint.ckpt_step=10",
                    f"distill.teacher_checkpoint={teacher}", f"dataset.dataset_root={data}", "dataset.do_test=false",
                    "--output", str(output))
    assert result.returncode == 0, result.stderr[-3000:]
    scores = json.loads(output.read_text())["splits"]["validation"]
    assert sorted(scores) == sorted(logged) == ["distill loss", "kl loss", "lm loss", "lm loss PPL"]
    ppl = scores.pop("lm loss PPL"), logged.pop("lm loss PPL")
    assert scores == pytest.approx(logged, abs=2e-6) and ppl[0] == pytest.approx(ppl[1], abs=5e-4)  # printed: .3f
    no_teacher = bridge("eval", "recipe=tiny_distill", f"checkpoint.load={save}", f"dataset.dataset_root={data}")
    assert no_teacher.returncode == 2 and "distill.teacher_checkpoint: is not set" in no_teacher.stderr


def test_the_teacher_is_frozen_and_has_no_optimizer_state(teacher, data):
    worker = python("tests/integration/distill_worker.py", str(teacher), str(data))
    assert worker.returncode == 0, worker.stderr[-3000:]
    assert "FROZEN eval=True requires_grad=0 grads=0 unchanged=True student_moved=True" in worker.stdout, worker.stdout
    optimized, student = (int(x) for x in re.search(r"OPTIMIZER elements=(\d+) student=(\d+)", worker.stdout).groups())
    assert optimized == student
    assert "SHAPES teacher=2x128 student=1x64" in worker.stdout


@pytest.fixture(scope="module")
def one_process(teacher, data):
    result = bridge(*distill(teacher, data, *SHORT))
    assert result.returncode == 0, result.stderr[-3000:]
    return curve(result.stdout)


@pytest.mark.parametrize("layout", [["model.tensor_model_parallel_size=2", "model.make_vocab_size_divisible_by=64"],
                                    ["model.tensor_model_parallel_size=1"]], ids=["tp2", "dp2"])
def test_two_processes_reproduce_the_single_process_curve(teacher, data, one_process, layout):
    """TP=2 splits the teacher as the student (both embeddings padded to 384 rows, as one process's), so the KL is
    summed over vocabulary slices; TP=1 on two processes is DP=2."""
    result = torchrun(2, *distill(teacher, data, *SHORT, *layout))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = numbers(curve(result.stdout))
    assert sorted(steps) == sorted(one_process) == list(range(1, 7))
    for step, values in numbers(one_process).items():
        assert steps[step] == pytest.approx(values, rel=1e-5, abs=1e-5), step


def test_a_resumed_run_prints_the_uninterrupted_curve(teacher, data, one_process, tmp_path):
    """Stopped at iteration 3 and resumed from checkpoint.load: the same digits at every iteration; the teacher is
    read again from distill.teacher_checkpoint, not from the student's checkpoint."""
    args = distill(teacher, data, *SHORT, f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=3")
    first = bridge(*args, "train.exit_interval=3")
    assert first.returncode == 0, first.stderr[-3000:]
    second = bridge(*args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming at iteration 3" in second.stdout and f"distillation teacher: {teacher} " in second.stdout
    steps = {**curve(first.stdout), **curve(second.stdout)}
    assert steps == one_process


def test_a_hugging_face_teacher_gives_the_checkpoint_teachers_numbers(teacher, data, one_process, tmp_path):
    hf = tmp_path / "hf"
    exported = bridge("convert-ckpt", "export-hf", str(teacher), str(hf))
    assert exported.returncode == 0, exported.stderr[-3000:]
    result = bridge(*distill(hf, data, "train.train_iters=2", "logger.log_interval=1", "train.eval_iters=0"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "converting the Hugging Face folder" in result.stdout
    steps = numbers(curve(result.stdout))
    for step in (1, 2):
        assert steps[step][:3] == pytest.approx(numbers(one_process)[step][:3], rel=1e-5, abs=1e-5), step


def test_lora_distillation_from_the_model_itself_starts_at_kl_0(teacher, data):
    """A LoRA student with the teacher's shape on the teacher's weights: B starts at 0, so the student is the
    teacher at first, and its adapters train on the KL and the CE."""
    result = bridge(*distill(teacher, data, "peft=lora", f"checkpoint.pretrained_checkpoint={teacher}",
                             "model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=512",
                             "train.train_iters=3", "logger.log_interval=1", "train.eval_iters=0"))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = numbers(curve(result.stdout))
    assert steps[1][1] == 0 and steps[3][1] > 0 and steps[3][0] < steps[1][0], steps


def test_packed_rows_distill(teacher, data):
    """Two SFT records and more per 128-token row: each attends to itself, in the teacher as in the student."""
    result = bridge(*distill(teacher, data, "dataset.packed_sequence_specs.packed_sequence_size=128",
                             "train.micro_batch_size=2", "train.global_batch_size=4", "train.train_iters=10",
                             "logger.log_interval=1", "train.eval_iters=0"))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = numbers(curve(result.stdout))
    assert sorted(steps) == list(range(1, 11)) and steps[10][1] < steps[1][1], steps


def test_bad_input_exits_2_naming_the_field_and_writes_nothing(cli, teacher, data, tmp_path):
    save = tmp_path / "ckpt"

    def finetune(*args):  # in this process: each fails before any process group or model exists
        return cli(*distill(teacher, data, f"checkpoint.save={save}", *args))

    other_vocabulary = finetune("tokenizer=null_tokenizer", "model.vocab_size=300")
    assert other_vocabulary.exit_code == 2, other_vocabulary.output
    assert "distill.teacher_checkpoint: the teacher's vocabulary has 259 tokens" in other_vocabulary.stderr
    assert "the model's 300" in other_vocabulary.stderr
    missing = cli(*distill(tmp_path / "nowhere", data, f"checkpoint.save={save}"))
    assert missing.exit_code == 2
    assert f"distill.teacher_checkpoint={tmp_path / 'nowhere'}: no checkpoint there" in missing.stderr
    unset = cli("finetune", "recipe=tiny_distill", f"dataset.dataset_root={data}", f"checkpoint.save={save}")
    assert unset.exit_code == 2 and "distill.teacher_checkpoint: is not set" in unset.stderr
    assert not save.exists()  # nothing half-written

    stages = finetune("model.num_layers=3", "model.pipeline_model_parallel_size=3", "--world-size", "3")
    assert stages.exit_code == 2, stages.output
    assert "distill.teacher_checkpoint: the teacher has 2 layers" in stages.stderr
    assert "3 pipeline stages" in stages.stderr
    context = finetune("model.context_parallel_size=2", "--world-size", "2")
    assert context.exit_code == 2
    assert "model.context_parallel_size: is 2 with finetune.objective=distill" in context.stderr
    cold = finetune("distill.temperature=0")
    assert cold.exit_code == 2 and "distill.temperature: must be > 0, got 0" in cold.stderr
    sft = cli("finetune", "recipe=tiny_sft", "distill.ce_weight=0.5", f"checkpoint.pretrained_checkpoint={teacher}",
              f"dataset.dataset_root={data}")
    assert sft.exit_code == 2 and "distill.ce_weight: is set, but finetune.objective is sft" in sft.stderr
    pretrain = cli("pretrain", "recipe=tiny_distill", f"distill.teacher_checkpoint={teacher}",
                   f"dataset.dataset_root={data}")
    assert pretrain.exit_code == 2 and "finetune.objective: is distill, which bridge finetune trains" in pretrain.stderr


def test_a_lora_adapter_teacher_is_refused_with_the_merge_command(cli, teacher, data, tmp_path):
    """A LoRA run's checkpoint holds adapters, not a model: the error names distill.teacher_checkpoint and says to
    merge them first (bridge peft merge), not the loader's peft=lora, which would put adapters on the student. Told
    by the run_config.yaml before any work, else by the common state when the teacher is loaded."""
    adapters, save = tmp_path / "lora", tmp_path / "student"
    made = bridge("finetune", "recipe=tiny_sft", f"checkpoint.pretrained_checkpoint={teacher}",
                  f"dataset.dataset_root={data}", "peft=lora", "train.train_iters=1", "train.eval_iters=0",
                  f"checkpoint.save={adapters}")
    assert made.returncode == 0, made.stderr[-3000:]
    advice = f"Merge the adapters into their base first: bridge peft merge {adapters} MERGED_DIR recipe=RECIPE"
    early = cli(*distill(adapters, data, f"checkpoint.save={save}"))
    assert early.exit_code == 2, early.output
    assert f"distill.teacher_checkpoint: {adapters} holds LoRA adapters" in early.stderr
    assert advice in early.stderr and f"their base: {teacher}" in early.stderr
    assert "peft=lora to load" not in early.stderr and not save.exists()

    run_config = next(adapters.glob("iter_*")) / "run_config.yaml"
    record = run_config.read_text()
    assert "\npeft:\n" in record
    run_config.write_text(record.replace("\npeft:\n", "\npeft_was:\n"))  # a record that does not say so
    late = bridge(*distill(adapters, data, "train.train_iters=1", "train.eval_iters=0"))
    assert late.returncode == 2, late.stderr[-3000:]
    assert f"distillation teacher: loading {adapters}" in late.stdout  # refused by the loading, not before
    assert f"distill.teacher_checkpoint: {adapters} holds LoRA adapters" in late.stderr and advice in late.stderr
    assert "peft=lora to load" not in late.stderr
