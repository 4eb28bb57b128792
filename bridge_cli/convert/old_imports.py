"""Imports written before ``import-hf`` mapped sliding windows: refused before a run trains or scores one past the
window, and given their window back when exported.

Until b8cf5f9 (27 November 2026) ``import-hf`` capped ``model.seq_length`` of a Mistral, Mixtral, Phi-3 or
StarCoder2 at config.json's ``sliding_window`` and wrote no ``model.window_size``: up to the window, full causal
attention is what the model computes. Run with a longer ``model.seq_length``, such a recipe attends over the whole
sequence without a word (a Mistral with a 16-token window scored at 64 tokens: loss 8.04 where transformers gives
7.95). Today's import writes ``model.window_size`` for every family that has windows (null where config.json has
none), so such a family's imported recipe without the key is an old one. The source folder its header names says
how long the window is; where it is gone, the import's own length is the safe bound (and export, which cannot
write a window it does not know, is refused). No torch import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from bridge_cli.checkpoint import layout, verify
from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.config.errors import ConfigError

CAPPED = ("mistral", "mixtral", "phi3", "starcoder2")
"""The families whose old import capped model.seq_length at the sliding window instead of mapping it."""
_HEADER = re.compile(r"^# (\S+) imported from (.+) by `bridge convert-ckpt import-hf`; "
                     r"training settings from recipe (\S+)\.$")
"""The line import-hf has written under ``# @package _global_`` of every recipe since its first version."""


@dataclass(frozen=True)
class OldImport:
    """An import-hf output folder whose recipe predates the mapped windows."""

    root: Path
    family: str
    source: Path
    """The Hugging Face folder it was imported from (it may be gone)."""
    base_recipe: str
    seq_length: int
    """Its recipe's model.seq_length: the window, or less."""

    def window_fields(self) -> Optional[dict[str, Any]]:
        """``window_size`` and ``window_attn_skip_freq`` as today's import maps the source's config.json (both None
        for a model without a window); None where that folder is gone or no longer converts."""
        from bridge_cli.convert import families, hf_config

        try:
            hf = hf_config.read_config(self.source)
            fields = families.FAMILIES[self.family].model_fields(hf, self.source / "config.json")
        except (CheckpointError, ConfigError, OSError):
            return None
        return {key: fields.get(key) for key in ("window_size", "window_attn_skip_freq")}

    def window(self) -> tuple[bool, Optional[int]]:
        """(known, the source's sliding window in tokens or None for none); (False, None) where the source is gone."""
        fields = self.window_fields()
        if fields is None:
            return False, None
        return True, None if fields["window_size"] is None else fields["window_size"][0] + 1


def check_seq_length(checkpoint, seq_length: int) -> None:
    """Refuse ``seq_length`` (model.seq_length of a run whose checkpoint section is ``checkpoint``) where the run
    starts from, or resumes a run trained from, an old import whose window it exceeds: a ConfigError naming
    model.seq_length, the window and the command that re-imports the folder."""
    old = find(checkpoint)
    if old is None or seq_length <= old.seq_length:
        return  # up to the import's length, full causal attention is the window's
    known, window = old.window()
    if known and (window is None or seq_length <= window):
        return
    limit = window if known else old.seq_length
    why = (f"{old.family}'s sliding window is {window} tokens ({old.source / 'config.json'})" if known else
           f"its source, {old.source}, is gone, so its sliding window is unknown beyond the {old.seq_length} tokens "
           "the import kept")
    raise ConfigError(
        "model.seq_length",
        f"{seq_length} reaches past the sliding window of the model imported in {old.root}: {why}. That import "
        "predates import-hf's mapping of sliding windows (its recipe has no model.window_size and capped "
        f"model.seq_length at {old.seq_length}), so at {seq_length} tokens every layer would attend to the whole "
        f"sequence, another model than the {old.family} it imported.",
        f"Re-import the folder: bridge convert-ckpt import-hf {old.source} {old.root}_windowed --recipe "
        f"{old.base_recipe} (its recipe carries model.window_size, which holds at any model.seq_length), then train "
        f"with recipe={old.root}_windowed/recipe.yaml; or keep model.seq_length at {limit} or less.")


def export_values(values: dict[str, Any], path: Path, saved: Optional[dict]) -> dict[str, Any]:
    """The ``model:`` values to export checkpoint ``path`` (an iteration folder, its run_config.yaml ``saved``) with:
    ``values``, and the sliding window of the old import it is, or was trained from, which they lack. Its training
    never reached past the window, so the windowed model is the one trained; exported without the window it would
    attend to whole sequences in transformers."""
    if values.get("window_size") is not None:
        return values
    roots = [path.parent, ((saved or {}).get("checkpoint") or {}).get("pretrained_checkpoint")]
    old = next((found for found in (_old_import(Path(root)) for root in roots if root) if found), None)
    if old is None:
        return values
    window = old.window_fields()
    if window is None:
        raise CheckpointError(
            f"{path} is, or was trained from, {old.root}: an import of a {old.family} from before import-hf mapped "
            "sliding windows, so its run_config.yaml has no model.window_size, and the source folder whose "
            f"config.json says the window, {old.source}, is gone. Exported without the window, the model would "
            f"attend to whole sequences in transformers. Put the Hugging Face folder back at {old.source} (its "
            "config.json is enough) and export again.")
    return {**values, **window} if window["window_size"] is not None else values


def find(checkpoint) -> Optional[OldImport]:
    """The old import a run with this checkpoint section starts from: ``checkpoint.pretrained_checkpoint`` or
    ``checkpoint.load`` where either is one, or the one named as pretrained_checkpoint by the run_config.yaml of the
    checkpoint ``load`` resumes."""
    roots = [checkpoint.pretrained_checkpoint, checkpoint.load]
    if checkpoint.load is not None and Path(checkpoint.load).is_dir():
        try:
            found = layout.find_checkpoint(Path(checkpoint.load)).path
        except CheckpointError:  # loading says what is wrong with it
            found = None
        saved = verify.saved_config(found) if found is not None else None
        roots.append(((saved or {}).get("checkpoint") or {}).get("pretrained_checkpoint"))
    for root in roots:
        old = _old_import(Path(root)) if root else None
        if old is not None:
            return old
    return None


def _old_import(root: Path) -> Optional[OldImport]:
    """``root`` as an old import of a family whose window it capped, or None."""
    import yaml

    recipe = root / "recipe.yaml"
    if not recipe.is_file():
        return None
    text = recipe.read_text()
    header = next((match for match in map(_HEADER.match, text.splitlines()[:3]) if match), None)
    if header is None or header.group(1) not in CAPPED:
        return None
    model: dict[str, Any] = (yaml.safe_load(text) or {}).get("model") or {}
    if "window_size" in model or not isinstance(model.get("seq_length"), int):
        return None
    family, source, base = header.groups()
    return OldImport(root, family, Path(source), base, model["seq_length"])
