"""How `bridge eval` shows its result: a table on the terminal, and the same numbers as JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional


def print_report(report, output: Optional[Path]) -> None:
    """``report`` (a :class:`bridge_cli.training.eval.EvalReport`) as a rich table; also as JSON to ``output``."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report.checkpoint} (iteration {report.iteration})",
                  caption=f"{report.eval_iters} batches of {report.global_batch_size} x {report.seq_length} "
                          "tokens per split")
    table.add_column("split")
    table.add_column("loss")
    table.add_column("value", justify="right")
    table.add_column("perplexity", justify="right")
    for split, values in report.splits.items():
        for name, value in values.items():
            if not name.endswith(" PPL"):
                ppl = values.get(f"{name} PPL")
                table.add_row(split, name, f"{value:.6f}", "" if ppl is None else f"{ppl:.3f}")
    Console().print(table)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(dataclasses.asdict(report), indent=2) + "\n")
        print(f"wrote {output}")
