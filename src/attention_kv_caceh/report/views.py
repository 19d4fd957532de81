"""The view/copy table's text and where `views` writes it: the Markdown table (`views_markdown`, what
the command prints and `--md` writes), the section beside its CSV and in the report (`views_section`),
and the command's output options (`ViewsOptions`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from attention_kv_caceh.experiments.views import ViewRow
from attention_kv_caceh.files import output_path
from attention_kv_caceh.options import check_options, option
from attention_kv_caceh.tables import markdown_table

__all__ = ["ViewsOptions", "views_markdown", "views_section"]


@dataclass(frozen=True)
class ViewsOptions:
    """Where `views` writes the table (both optional: it is printed anyway)."""

    csv: Path | None = option(
        None,
        help="write the table as CSV, plus <csv>.meta.json and the run's Markdown <stem>.md beside it",
        metavar="PATH.csv",
        parse=output_path(".csv"),
        default_text="not written",
    )
    md: Path | None = option(
        None,
        help="write the table as Markdown",
        metavar="PATH.md",
        parse=output_path(".md", ".markdown"),
        default_text="not written",
    )

    def __post_init__(self) -> None:
        check_options(self)


def views_section(name: str, rows: Sequence[ViewRow]) -> str:
    """The section of one view/copy table CSV (`views_markdown` of its rows)."""
    return f"### View/copy table: `{name}`\n\n{views_markdown(rows)}"


def views_markdown(rows: Sequence[ViewRow]) -> str:
    """Render the rows as a Markdown table ("predicted / observed" in the prediction columns)."""

    def pair(predicted: object, observed: object) -> str:
        return f"{predicted} / {observed}"

    header = [
        "experiment",
        "code",
        "write",
        "shares memory (pred / obs)",
        "write propagates (pred / obs)",
        "shape",
        "strides (bytes)",
        "C_CONTIGUOUS (pred / obs)",
        "prediction held",
        "why",
    ]
    cells = [
        [
            r.experiment,
            f"`{r.code}`",
            f"`{r.write}`",
            pair(r.predicted_shares_memory, r.shares_memory),
            pair(r.predicted_write_propagates, r.write_propagates),
            r.shape,
            r.strides,
            pair(r.predicted_c_contiguous, r.c_contiguous),
            "yes" if r.prediction_held else "**no**",
            r.explanation,
        ]
        for r in rows
    ]
    return markdown_table(header, cells)
