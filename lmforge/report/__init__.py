"""Run comparison: loss, gradient norm, throughput, time and cost of several runs side by side."""

from lmforge.report.compare import Report, compare, text_table
from lmforge.report.runs import Run, derive_labels, load_run, summarize

__all__ = ["Report", "Run", "compare", "derive_labels", "load_run", "summarize", "text_table"]
