"""Summary table, plots and model cards."""

from eagleflow.errors import NotImplementedStage


def summarize(inputs: dict, bench_cfg: dict, out_csv: str, out_md: str) -> None:
    """The summary table from the raw benchmark and acceptance records."""
    raise NotImplementedStage("summarize", "issue #7")


def plot_results(inputs: dict, report_cfg: dict, out_dir: str) -> None:
    """Every plot of the report."""
    raise NotImplementedStage("plot_results", "issue #7")


def write_cards(inputs: dict, report_cfg: dict, out: str) -> None:
    """Model card with the measured figures (never into the exports)."""
    raise NotImplementedStage("write_cards", "issue #7")
