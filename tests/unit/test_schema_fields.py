"""No silent fields: every field of bridge's own sections is read by the code, or setting it away from
its default is a ConfigError naming it (bridge_cli/config/unsupported.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from bridge_cli.config.schema import DATASETS, PEFT, SECTIONS
from bridge_cli.config import unsupported

PACKAGE = Path(__file__).resolve().parents[2] / "bridge_cli"
DEFINITIONS = {  # the modules that declare the sections' fields
               "runtime_configs.py", "data_configs.py", "loop_configs.py", "checkpoint_config.py",
               "logger_config.py", "peft_config.py", "comm_overlap_config.py", "finetune_config.py"}


def schema_fields() -> list[tuple[str, type, dataclasses.Field]]:
    sections = {**SECTIONS, **{f"dataset:{k}": v for k, v in DATASETS.items()}, **{f"peft:{k}": v for k, v in PEFT.items()}}
    return [(name.split(":")[0], cls, f) for name, cls in sections.items() for f in dataclasses.fields(cls)]


def code_without_field_declarations() -> str:
    """The package's code, less the lines that declare the fields (a check() that reads one still counts)."""
    declaration = re.compile(r"^\s+\w+: [^=]+= ")
    texts = []
    for path in PACKAGE.rglob("*.py"):
        lines = path.read_text().splitlines()
        if path.parent.name == "config" and path.name in DEFINITIONS:
            lines = [line for line in lines if not declaration.match(line)]
        texts.append("\n".join(lines))
    return "\n".join(texts)


def passed_to_megatron_core_datasets() -> set[str]:
    """GPT dataset fields handed on, by name, to megatron-core's GPTDatasetConfig (data/builders.py)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    return {f.name for f in dataclasses.fields(GPTDatasetConfig) if f.init}


def is_unsupported(section: str, name: str) -> bool:
    return section in unsupported.REFUSED or f"{section}.{name}" in unsupported.REFUSED


def test_every_field_is_read_or_refused():
    code, mcore_dataset = code_without_field_declarations(), passed_to_megatron_core_datasets()
    silent = []
    for section, cls, f in schema_fields():
        if is_unsupported(section, f.name):
            continue
        read = re.search(rf"\.{f.name}\b|[\"']{f.name}[\"']", code)
        handed_on = section == "dataset" and f.name in mcore_dataset
        if not (read or handed_on):
            silent.append(f"{section}.{f.name}")
    assert not silent, f"accepted and never read: {silent}; read them or list them in config/unsupported.py"


def test_every_refused_key_is_a_schema_field():
    from bridge_cli.config.schema import mcore_sections

    keys = {f"{section}.{f.name}" for section, _, f in schema_fields()} | {s for s, _, _ in schema_fields()}
    keys |= {f"{section}.{f.name}" for section, cls in mcore_sections().items() for f in dataclasses.fields(cls)}
    assert not set(unsupported.REFUSED) - keys


@pytest.mark.parametrize("key", [key for key, refused in unsupported.REFUSED.items() if refused.launcher])
def test_setting_a_launcher_field_is_a_config_error(key):
    """The model fields Megatron-LM's launcher acts on: refused once comm_overlap has written its fields."""
    from bridge_cli.config.compose import compose
    from bridge_cli.config.errors import ConfigError
    from bridge_cli.training.config import ConfigContainer

    cfg = ConfigContainer.from_yaml_dict(compose("tiny", []))
    name = key.split(".", 1)[1]
    f = next(f for f in dataclasses.fields(cfg.model) if f.name == name)
    setattr(cfg.model, name, True if f.type in (bool, "bool") else non_default(f))
    with pytest.raises(ConfigError) as err:
        cfg.validate(1, "cpu")
    assert err.value.key == key and unsupported.REFUSED[key].message() in str(err.value)


def non_default(f: dataclasses.Field):
    from bridge_cli.config.fields import choices_of

    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    others = [choice for choice in choices_of(f) or () if choice != default]
    if others:
        return others[0]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 3
    if isinstance(default, str):
        return "other"
    return ["x"] if "list" in str(f.type) else ("x" if "str" in str(f.type) else 7)


REFUSED = sorted({(section, f.name) for section, cls, f in schema_fields() if is_unsupported(section, f.name)
                  and (section != "dataset" or cls is DATASETS["gpt"] or f.name == "memmap_workers")})


@pytest.mark.parametrize("section, name", REFUSED)
def test_setting_an_unsupported_field_is_a_config_error(section, name):
    from bridge_cli.config.compose import compose
    from bridge_cli.config.errors import ConfigError
    from bridge_cli.training.config import ConfigContainer

    cls = {**SECTIONS, "dataset": DATASETS["finetune" if name == "memmap_workers" else "gpt"]}[section]
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    overrides = ["dataset=finetune"] if name == "memmap_workers" else []
    cfg = ConfigContainer.from_yaml_dict(compose("tiny", overrides))
    setattr(getattr(cfg, section), name, non_default(f))
    with pytest.raises(ConfigError) as err:
        cfg.validate(1, "cpu")
    refused = unsupported.REFUSED.get(f"{section}.{name}") or unsupported.REFUSED[section]
    assert err.value.key == f"{section}.{name}" and refused.message() in str(err.value)


def test_a_user_sees_the_refusal_from_the_cli(cli):
    result = cli("pretrain", "recipe=tiny", "rng.te_rng_tracker=true")
    assert result.exit_code == 2 and "error: rng.te_rng_tracker: is not supported" in result.stderr, result.output


def test_the_docs_list_of_refused_fields_is_the_table():
    from bridge_cli.config.unsupported import markdown
    from tests.conftest import REPO

    page = (REPO / "docs" / "running.md").read_text()
    listed = page.split("<!-- refused fields: python -m bridge_cli.config.unsupported -->\n", 1)[1]
    listed = listed.split("<!-- end of refused fields -->", 1)[0]
    assert listed == markdown(), "docs/running.md's refused fields are stale: python -m bridge_cli.config.unsupported"
