"""``dist.nccl_communicator_config_path`` and ``dist.high_priority_stream_groups``: a group name megatron-core does not
create, a setting it does not read or a value of the wrong type would be taken and never applied; each is refused
naming the field, the file and the entry. On the CPU both are refused (NCCL settings). tests/gpu/test_gpu_nccl_groups.py
checks that megatron-core's groups get them on GPUs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bridge_cli.config.errors import ConfigError
from bridge_cli.runtime.nccl_groups import check_nccl_groups, group_names, read_settings
from tests.conftest import bridge


def dist(path=None, groups=None):
    return SimpleNamespace(nccl_communicator_config_path=path, high_priority_stream_groups=groups)


def test_the_group_names_are_the_installed_megatron_cores():
    assert {"dp", "dp_cp", "tp", "pp", "ep", "ep_dp"} <= set(group_names())


def test_a_settings_file_megatron_core_applies_as_written_passes(tmp_path):
    path = tmp_path / "nccl.yaml"
    path.write_text("dp_cp: {max_ctas: 8, min_ctas: 2, is_high_priority_stream: true}\nep: {net_name: IB}\n")
    assert read_settings(str(path))["dp_cp"]["max_ctas"] == 8
    check_nccl_groups(dist(str(path), ["dp_cp", "ep"]))


@pytest.mark.parametrize("text, says", [
    ("dpcp: {max_ctas: 8}", "'dpcp' names no process group megatron-core creates. Did you mean dp_cp"),
    ("dp_cp: {max_cta: 8}", "dp_cp.max_cta is no NCCL setting megatron-core applies"),
    ("dp_cp: {max_ctas: eight}", "dp_cp.max_ctas is 'eight', not an int"),
    ("dp_cp: {max_ctas: 0}", "dp_cp.max_ctas is 0; it must be at least 1"),
    ("dp_cp: {is_high_priority_stream: 1}", "dp_cp.is_high_priority_stream is 1, not a bool"),
    ("dp_cp: {net_name: ethernet}", "dp_cp.net_name is 'ethernet'; megatron-core takes IB or socket"),
    ("dp_cp: 8", "dp_cp maps to 8, not to settings"),
    ("- dp_cp", "holds no mapping of process-group names to NCCL settings"),
    ("dp_cp: {max_ctas: [", "is not YAML"),
])
def test_what_would_not_apply_is_refused_naming_the_entry(tmp_path, text, says):
    path = tmp_path / "nccl.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="dist.nccl_communicator_config_path") as refused:
        check_nccl_groups(dist(str(path)))
    assert says in str(refused.value), str(refused.value)


def test_a_missing_file_and_an_unknown_high_priority_group_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"dist.nccl_communicator_config_path: .*nccl.yaml is not a file"):
        check_nccl_groups(dist(str(tmp_path / "nccl.yaml")))
    with pytest.raises(ConfigError, match=r"dist.high_priority_stream_groups: 'data' names no process group"):
        check_nccl_groups(dist(groups=["dp_cp", "data"]))


def test_on_the_cpu_they_are_refused_and_a_gpu_config_checks_from_the_cpu(tmp_path):
    path = tmp_path / "nccl.yaml"
    path.write_text("dp_cp: {max_ctas: 8}\n")
    cpu = bridge("pretrain", "recipe=tiny", f"dist.nccl_communicator_config_path={path}", "--dry-run")
    assert cpu.returncode == 2 and "Traceback" not in cpu.stderr, cpu.stderr[-2000:]
    assert "dist.nccl_communicator_config_path" in cpu.stderr and "=null" in cpu.stderr, cpu.stderr[-2000:]
    gpu = bridge("pretrain", "recipe=gpt2_124m", f"dist.nccl_communicator_config_path={path}",
                 "dist.high_priority_stream_groups=[dp_cp,ep]", "--dry-run", "--device", "cuda", "--world-size", "2")
    assert gpu.returncode == 0, gpu.stderr[-2000:]
