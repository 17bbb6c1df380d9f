"""The report tests' shared `run`: the report stage on the hand-built records of _fixtures.

Package-scoped: built once for test_table, test_plots and test_cards (it only reads it).
"""

from __future__ import annotations

import pytest

from eagleflow.report import plots as report_plots
from tests.unit.report._fixtures import BENCH, REPORT, build, make_records


@pytest.fixture(scope="package")
def run(tmp_path_factory):
    """The default-shaped run: one concurrency level, two repeats, all inputs present."""
    root = tmp_path_factory.mktemp("report")
    records = make_records()
    paths = build(root, records)
    inputs = {k: paths[k] for k in ("summary", "acceptance", "metrics", "manifest")}
    table = root / "summary.html"
    index = report_plots.plot_results(inputs, REPORT, str(root / "plots"), BENCH, str(table))
    return {"root": root, "records": records, "paths": paths, "index": index, "table": table}
