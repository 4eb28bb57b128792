"""docs/conversion_fields.md is what the families' tables say, so the documented contract cannot drift from the code."""

from __future__ import annotations

from bridge_cli.convert import field_table
from bridge_cli.convert.families import FAMILIES
from tests.conftest import REPO

PAGE = REPO / "docs" / "conversion_fields.md"


def test_the_page_is_the_families_tables_as_written_now():
    assert PAGE.read_text() == field_table.markdown(), (
        "docs/conversion_fields.md is stale: python -m bridge_cli.convert.field_table > docs/conversion_fields.md")


def test_every_family_has_its_section_with_its_three_lists():
    text = field_table.markdown()
    for model_type, family in FAMILIES.items():
        section = text.split(f"## {model_type}\n", 1)[1].split("\n## ", 1)[0]
        for key in (*family.mapped_keys, *family.inert_keys, *family.assumed):
            assert f"`{key}`" in section, (model_type, key)
