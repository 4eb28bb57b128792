"""The conversion contract as a page: for each family, the fields of its transformers config class that bridge maps
onto the model, assumes (config.json giving another value is refused, naming the field), or ignores as inert (the
logits do not depend on them).

docs/conversion_fields.md is this module's output, so the page cannot drift from the families' tables
(``tests/unit/test_conversion_fields_doc.py`` keeps them equal); after changing a family, write it again with

    python -m bridge_cli.convert.field_table > docs/conversion_fields.md
"""

from __future__ import annotations

from bridge_cli.convert.families import FAMILIES

HEADER = """# Hugging Face config fields, family by family

Written by `python -m bridge_cli.convert.field_table` from the families' own tables in
`bridge_cli/convert/families/`; do not edit by hand. Every field of a family's transformers config class is in
one of three lists, and `tests/unit/test_hf_defaults.py` fails on a field in none of them:

- **mapped**: read from config.json (a key it leaves out means the config class's default) and carried into the
  model;
- **assumed**: the value the converted model is built for; config.json giving another is refused with exit 2,
  naming the field and the file;
- **inert**: the logits do not depend on it (generation settings, token ids, training-time dropout).

A family may refuse more combinations in its own checks (see [conversion.md](conversion.md)).
"""


def markdown() -> str:
    """The page: one section per family, in model_type order."""
    sections = [HEADER]
    for model_type, family in sorted(FAMILIES.items()):
        assumed = ", ".join(f"`{key}` = `{value!r}`" for key, value in sorted(family.assumed.items())) or "none"
        sections.append(f"## {model_type}\n\n"
                        f"- mapped: {_names(family.mapped_keys)}\n"
                        f"- assumed: {assumed}\n"
                        f"- inert: {_names(family.inert_keys)}\n")
    return "\n".join(sections)


def _names(keys) -> str:
    return ", ".join(f"`{key}`" for key in sorted(set(keys))) or "none"


if __name__ == "__main__":
    print(markdown(), end="")
