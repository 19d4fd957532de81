"""The results report: read every raw file in a results folder and write the findings back as Markdown.

It reads every kind of raw file, the lab's and the serving harness's, so it sits beside `experiments/`
and `harness/` and imports from both; nothing there imports it. Statistics are recomputed from raw
samples only (`timing.summarize_samples` through `scan_stats.scan_table` and
`cache_growth_stats.summarize_cache_growth`); summary files in the folder are listed and ignored. A
file's kind is the `kind` its run recorded in its `.meta.json` (`readers.kind_of`; its header must
agree), or, for a file with no metadata or none recording a kind (older runs), its CSV header; never
its name:

- batch-size scan raw CSV: the fields of `timing.Sample`; its `<csv>.meta.json` gives the environment,
  the read-bandwidth probe samples and the KV bytes per step.
- cache-growth raw CSV (`CacheStepSample` fields) and its memory CSV (`CacheMemoryRow` fields), paired
  by their run parameters.
- the view/copy table (`ViewRow` fields).
- serving-harness per-request JSONL (`*.jsonl`): records rebuilt from their raw timestamps and summarized
  by the harness's own `summarize_run` (completed requests only).
- a sweep's `sweep.csv` (`harness.sweep.CSV_FIELDS`, a row per point and repeat) with the `sweep.json`
  beside it: the runs' table, the knee by `harness.sweep.find_knee`, an SLO search's tries.

Outliers are flagged (a sample above 2 x the P95 of its group) and kept. A missing or malformed file is
named with what is wrong, and everything else is still reported: a raw-file name that is not a regular
file (a FIFO is never opened for reading), a suffix in another case (`B.CSV`), a file above
`MAX_INPUT_BYTES`, a file that mixes runs or repeats a row, a request whose timestamps run backwards.
A run's recorded `prediction` is rebuilt and checked against its raw rows. Plots go beside the report.

Modules: `sources` (open regular files, size cap, metadata), `readers` (kinds; parse and check
CSVs), `jsonl` (per-request records), `sections` (the Markdown of each lab kind, with the statistics it
formats), `predictions` (one lab run's Markdown: its section and its prediction against the
measurement; the scan, `cache` and `views` commands write the same text beside their raw CSV),
`outcome` and `verdicts` (a prediction's cards, tables, verdict lines and paragraphs), `scan_text`,
`cache_text` and `overhead` (what the lab commands print),
`serving` (the serving run's section), `sweep` (a sweep's CSV read and its section), `environment` (the environment card), `plots` (matplotlib, PNG
out; the scan and cache commands draw with it too), `build` (`build_report`: one handler per file
kind). Tables go through `tables.markdown_table`, the project's one table writer.
"""

from __future__ import annotations

from attention_kv_caceh.report.build import build_report, planned_plots
from attention_kv_caceh.report.readers import classify_header, parse_rows
from attention_kv_caceh.report.sections import OUTLIER_FACTOR, flag_outliers
from attention_kv_caceh.report.sources import MAX_INPUT_BYTES, FileProblem, ReportResult

__all__ = [
    "MAX_INPUT_BYTES",
    "OUTLIER_FACTOR",
    "FileProblem",
    "ReportResult",
    "build_report",
    "classify_header",
    "flag_outliers",
    "parse_rows",
    "planned_plots",
]
