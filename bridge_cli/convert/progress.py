"""A per-tensor progress bar for conversions (rich, on a terminal only; logs and pipes stay clean)."""

from __future__ import annotations

import sys
from typing import Iterator, Sequence

from bridge_cli.convert.hf_weights import Pair


def per_tensor(pairs: Sequence[Pair], label: str) -> Iterator[Pair]:
    """Yield ``pairs``, showing which megatron-core tensor is being converted and how many are left."""
    if not sys.stderr.isatty():
        yield from pairs
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
               TextColumn("{task.description}"))
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("", total=len(pairs))
        for pair in pairs:
            bar.update(task, description=pair.mcore_names[0])
            yield pair
            bar.advance(task)
