"""The report's plots on hand-built raw records: images drawn, no-data panels, the data-size study.

The records and the shared `run` come from _fixtures.py and conftest.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleflow.report import plots as report_plots
from tests.unit.report._fixtures import (
    BENCH,
    REPORT,
    STANDALONE,
    build,
    make_acceptance,
    make_records,
)


def _check_image(path: Path) -> None:
    from matplotlib.image import imread

    assert path.stat().st_size > 10_000, f"{path.name} is suspiciously small"
    pixels = imread(path)
    assert pixels.shape[0] >= 400 and pixels.shape[1] >= 600, pixels.shape
    assert pixels[..., :3].std() > 0.02, f"{path.name} is (nearly) blank"


def test_plots_are_nonempty_images(run):
    plots = {p["name"]: p for p in run["index"]["plots"]}
    assert set(plots) == set(report_plots.PLOTS)
    for name, plot in plots.items():
        assert plot["files"] == [f"{name}.png", f"{name}.svg"]
        _check_image(run["root"] / "plots" / f"{name}.png")
        assert "<svg" in (run["root"] / "plots" / f"{name}.svg").read_text()[:2000]
    drawn = {n for n, p in plots.items() if not p["no_data"]}
    assert drawn == set(report_plots.PLOTS) - {"throughput_concurrency", "data_size", "levers"}
    assert "no data-size study" in plots["data_size"]["no_data"]
    assert "no levers" in plots["levers"]["no_data"]
    assert not (run["root"] / "plots" / report_plots.LEVERS_TABLE).exists()
    assert plots["acceptance_by_position"]["data"]["series"][1]["num_steps"] == 5
    assert plots["training"]["data"]["val_points"] == 3
    assert plots["extraction"]["data"]["extract_tokens_per_s"] == pytest.approx(812.5)


def test_missing_data_draws_a_no_data_panel(run, tmp_path):
    plots = {p["name"]: p for p in run["index"]["plots"]}
    assert "only concurrency 1 was measured" in plots["throughput_concurrency"]["no_data"]
    paths = build(tmp_path, make_records(), val=False, acceptance=False, tokens_per_s=None)
    inputs = {k: paths[k] for k in ("summary", "metrics", "manifest")}
    index = report_plots.plot_results(
        inputs, {**REPORT, "formats": ["png"]}, str(tmp_path / "p"), BENCH
    )
    plots = {p["name"]: p for p in index["plots"]}
    assert "did not run" in plots["acceptance_by_position"]["no_data"]
    assert "extracted 0 new tokens" in plots["extraction"]["no_data"]
    assert plots["training"]["data"]["note"] == "no validation rows"
    assert plots["accept_length"]["no_data"] is None  # served bars still drawn
    for name in report_plots.PLOTS:
        _check_image(tmp_path / "p" / f"{name}.png")
        assert not (tmp_path / "p" / f"{name}.svg").exists()


def test_data_size_plot_joins_the_study_and_this_run(tmp_path):
    paths = build(tmp_path, make_records())
    study = []
    for n, al, acc in ((500, 1.6, 0.3), (1500, 2.1, 0.5)):
        rec = make_acceptance()
        rec["by_num_steps"] = {"3": {**rec["by_num_steps"]["3"], "accept_length": al}}
        (tmp_path / f"n{n}.json").write_text(json.dumps(rec))
        summary = {"best_val": {"loss": 9.0, "full_acc_0": acc, "full_acc_1": acc / 2}}
        (tmp_path / f"t{n}.json").write_text(json.dumps(summary))
        study.append({"conversations": n, "acceptance": str(tmp_path / f"n{n}.json"),
                      "train_summary": str(tmp_path / f"t{n}.json")})  # fmt: skip
    study[0].pop("acceptance")  # a size with its validation figure only
    inputs = {k: paths[k] for k in ("summary", "acceptance", "metrics", "manifest", "train")}
    cfg = {**REPORT, "formats": ["png"], "data_size": study[::-1]}
    index = report_plots.plot_results(inputs, cfg, str(tmp_path / "p"), BENCH)
    data = {p["name"]: p for p in index["plots"]}["data_size"]["data"]
    # num_steps 3 is in every acceptance record; this run is its manifest's 320 samples
    assert data["num_steps"] == 3
    assert [(p["conversations"], p["accept_length"]) for p in data["standalone"]] == [
        (320, STANDALONE["3"]), (1500, 2.1)]  # fmt: skip
    assert data["standalone"][0]["run"] == "this run"
    # validation estimate: 1 + sum of the best validation's full accuracies (build: 0.74)
    assert [(p["conversations"], p["accept_length"]) for p in data["validation"]] == [
        (320, pytest.approx(1.74)),
        (500, pytest.approx(1.45)),
        (1500, pytest.approx(1.75)),
    ]
    _check_image(tmp_path / "p" / "data_size.png")
    # acceptance records without a common num_steps and no validation: said, not drawn
    bad = make_acceptance()
    bad["by_num_steps"] = {"4": bad["by_num_steps"]["3"]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    cfg["data_size"] = [{"conversations": 9, "acceptance": str(tmp_path / "bad.json")}]
    inputs.pop("train")
    index = report_plots.plot_results(inputs, cfg, str(tmp_path / "q"), BENCH)
    assert "fewer than two sizes" in {p["name"]: p for p in index["plots"]}["data_size"]["no_data"]


def test_levers_table_gives_every_variant_at_every_temperature_and_num_steps(tmp_path):
    paths = build(tmp_path, make_records())
    sampled = make_acceptance()  # a variant checked greedy and at T=1, 3 steps only
    greedy3 = {**sampled["by_num_steps"]["3"], "accept_length": 2.9}
    t1 = {**sampled["by_num_steps"]["3"], "accept_length": 2.4}
    by_t = {"0": {"temperature": 0.0, "by_num_steps": {"3": greedy3}},
            "1": {"temperature": 1.0, "by_num_steps": {"3": t1}}}  # fmt: skip
    sampled = {"by_temperature": by_t}
    (tmp_path / "lk.json").write_text(json.dumps(sampled))
    (tmp_path / "lk_train.json").write_text(
        json.dumps({"best_val": {"full_acc_0": 0.8, "full_acc_1": 0.6}})
    )
    levers = [{"name": "loss lk_hybrid", "acceptance": str(tmp_path / "lk.json"),
               "train_summary": str(tmp_path / "lk_train.json"),
               "command": "snakemake --config train='{loss: lk_hybrid}'",
               "note": "LK loss"}]  # fmt: skip
    inputs = {k: paths[k] for k in ("summary", "acceptance", "metrics", "manifest", "train")}
    cfg = {**REPORT, "formats": ["png"], "levers": levers}
    index = report_plots.plot_results(inputs, cfg, str(tmp_path / "p"), BENCH)
    plot = {p["name"]: p for p in index["plots"]}["levers"]
    assert plot["no_data"] is None
    data = plot["data"]
    assert data["columns"] == ["T=0 k=3", "T=0 k=5", "T=1 k=3"]
    lk, this = data["rows"]
    assert lk["name"] == "loss lk_hybrid" and this["name"] == "this run"
    assert lk["accept_length"] == {"T=0 k=3": 2.9, "T=0 k=5": None, "T=1 k=3": 2.4}
    assert this["accept_length"] == {"T=0 k=3": STANDALONE["3"], "T=0 k=5": STANDALONE["5"],
                                     "T=1 k=3": None}  # fmt: skip
    assert lk["validation"] == pytest.approx(2.4) and lk["ttt_steps"] == 2
    assert this["validation"] == pytest.approx(1.74)
    table = (tmp_path / "p" / report_plots.LEVERS_TABLE).read_text()
    assert "| loss lk_hybrid | 2.900 | – | 2.400 | 2.400 (k=2) |" in table
    assert "| this run | 2.600 | 3.000 | – | 1.740 (k=1) |" in table
    assert "`snakemake --config train='{loss: lk_hybrid}'` — LK loss" in table
    _check_image(tmp_path / "p" / "levers.png")


def test_throughput_vs_concurrency_draws_every_level(tmp_path):
    paths = build(tmp_path, make_records(concurrency=(1, 4)))
    inputs = {k: paths[k] for k in ("summary", "acceptance", "metrics", "manifest")}
    index = report_plots.plot_results(
        inputs, {**REPORT, "formats": ["png"]}, str(tmp_path / "p"), BENCH
    )
    plots = {p["name"]: p for p in index["plots"]}
    lines = {line["config"]: line for line in plots["throughput_concurrency"]["data"]["lines"]}
    assert set(lines) == {"baseline", "s3", "s5"} and lines["s3"]["x"] == [1, 4]
    assert lines["s3"]["y"][1] == pytest.approx(lines["s3"]["y"][0] * 2)
    assert len(plots["speedup"]["data"]["bars"]) == 4  # two configs x two levels
    _check_image(tmp_path / "p" / "throughput_concurrency.png")
