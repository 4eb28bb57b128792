"""`bridge preprocess-data`: JSONL or text files -> a megatron-core indexed dataset (.bin/.idx)."""

from __future__ import annotations

import sys
import time
from enum import Enum
from typing import Annotated, Optional

import typer

from bridge_cli.cli.errors import handles_user_errors


class TokenizerType(str, Enum):
    ByteLevelTokenizer = "ByteLevelTokenizer"
    HuggingFaceTokenizer = "HuggingFaceTokenizer"
    SentencePieceTokenizer = "SentencePieceTokenizer"


class OnError(str, Enum):
    fail = "fail"
    skip = "skip"


@handles_user_errors
def preprocess_data(
    input: Annotated[list[str], typer.Option(
        "--input", "-i", show_default=False,
        help="A file or a quoted glob (repeatable). .jsonl/.json/.ndjson: one JSON document per line; "
             "any other file: its whole text is one document.")],
    output_prefix: Annotated[str, typer.Option(
        "--output-prefix", "-o", show_default=False,
        help="Writes PREFIX.bin and PREFIX.idx; train with dataset.blend=[PREFIX].")],
    tokenizer_type: Annotated[TokenizerType, typer.Option(
        "--tokenizer-type", help="Must match tokenizer.tokenizer_type of the training run.")],
    tokenizer_model: Annotated[Optional[str], typer.Option(
        "--tokenizer-model", help="Hugging Face tokenizer folder or SentencePiece .model file.")] = None,
    trust_remote_code: Annotated[bool, typer.Option(
        "--trust-remote-code", help="Let a Hugging Face tokenizer run code shipped with its files.")] = False,
    json_key: Annotated[str, typer.Option("--json-key", help="Key holding each JSON document's text.")] = "text",
    workers: Annotated[int, typer.Option("--workers", "-w", help="Tokenizing processes.")] = 1,
    append_eod: Annotated[bool, typer.Option(
        "--append-eod/--no-append-eod", help="End every document with the tokenizer's end-of-document token.")] = True,
    on_error: Annotated[OnError, typer.Option(
        "--on-error", help="A malformed document (bad JSON line, no --json-key, not UTF-8): stop at its "
                          "file:line (fail) or report it and go on (skip).")] = OnError.fail,
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="Documents handed to a worker at a time.")] = 64,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Tokenize JSONL or text files into a megatron-core indexed dataset (.bin/.idx) for dataset=gpt."""
    from bridge_cli.config.data_configs import TokenizerConfig
    from bridge_cli.data.preprocess import preprocess_data as run
    from bridge_cli.runtime.mcore_import import import_megatron_core

    import_megatron_core()
    tokenizer = TokenizerConfig(tokenizer_type=tokenizer_type.value, tokenizer_model=tokenizer_model,
                                trust_remote_code=trust_remote_code)
    with ProgressReport() as progress:
        stats = run(input, output_prefix, tokenizer, json_key=json_key, workers=workers, append_eod=append_eod,
                    on_error=on_error.value, chunk_size=chunk_size, on_progress=progress.update,
                    on_skip=progress.warn)
    seconds = max(stats.seconds, 1e-9)
    skipped = f", skipped {stats.skipped} malformed document(s)" if stats.skipped else ""
    typer.echo(f"preprocessed {stats.documents:,} documents, {stats.tokens:,} tokens in {seconds:.2f} s "
               f"({stats.documents / seconds:,.0f} docs/s, {stats.tokens / seconds:,.0f} tokens/s){skipped} "
               f"-> {', '.join(stats.outputs)}")


class ProgressReport:
    """A rich progress bar over the input bytes on a terminal; otherwise a plain line every 10 s."""

    PLAIN_INTERVAL_S = 10.0

    def __init__(self):
        self.bar = None
        self.last_line = time.time()

    def __enter__(self) -> "ProgressReport":
        if sys.stdout.isatty():
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("tokenizing"), BarColumn(bar_width=16), DownloadColumn(),
                                TimeRemainingColumn(), TextColumn("{task.fields[rates]}"), transient=True)
            self.task = self.bar.add_task("tokenizing", total=None, rates="")
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, stats) -> None:
        now = time.time()
        if self.bar is not None:
            self.bar.update(self.task, total=stats.total_bytes, completed=stats.bytes_done, rates=_rates(stats))
        elif now - self.last_line >= self.PLAIN_INTERVAL_S:
            self.last_line = now
            print(f"{stats.bytes_done / max(stats.total_bytes, 1):.0%} of the input | {_rates(stats)}", flush=True)

    def warn(self, message: str) -> None:
        if self.bar is not None:
            self.bar.console.print(message, style="yellow", highlight=False, markup=False)
        else:
            print(message, file=sys.stderr, flush=True)


def _rates(stats) -> str:
    seconds = max(stats.seconds, 1e-9)
    return (f"{stats.documents:,} docs | {stats.documents / seconds:,.0f} docs/s | "
            f"{stats.tokens / seconds:,.0f} tokens/s")
