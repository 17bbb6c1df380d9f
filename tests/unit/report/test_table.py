"""The summary table on hand-built raw records: numbers recomputed, mismatch shown, same answers.

The records and the shared `run` come from _fixtures.py and conftest.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleflow.report import plots as report_plots
from eagleflow.report import table as report_table
from eagleflow.serve.bench import MISMATCH
from tests.unit.report._fixtures import BENCH, STANDALONE, make_acceptance


def _median(xs):
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def test_summary_row_recomputed_from_raw_runs(run):
    records = {r["config"]: r for r in run["records"]}
    tput = {
        name: [r["output_tokens"] / r["wall_s"] for r in rec["runs"] if r["concurrency"] == 1]
        for name, rec in records.items()
    }
    s3 = records["s3"]["runs"]
    base = _median(tput["baseline"])
    served = _median([r["accept_length"] for r in s3])
    ttfts = [q["ttft_s"] for r in s3 for q in r["requests"]]
    expected = {
        "repeats": 2,
        "throughput_median": _median(tput["s3"]),
        "throughput_min": min(tput["s3"]),
        "throughput_max": max(tput["s3"]),
        "speedup": _median(tput["s3"]) / base,
        "speedup_min": min(tput["s3"]) / base,
        "speedup_max": max(tput["s3"]) / base,
        "accept_len_served": served,
        "accept_len_standalone": STANDALONE["3"],
        "accept_ratio": served / STANDALONE["3"],
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "output_tokens": sum(r["output_tokens"] for r in s3),
    }

    # a step as a request sees it: decode time (after the first token) over decode steps, a
    # verify pass each for s3 (vLLM's num_drafts), a token each for the baseline
    def step(r, steps):
        return sum(q["wall_s"] - q["ttft_s"] for q in r["requests"]) / steps

    s3_step = _median([step(r, r["spec"]["drafts"]) for r in s3])
    base_runs = [r for r in records["baseline"]["runs"] if r["concurrency"] == 1]
    base_step = _median(
        [step(r, sum(q["output_tokens"] - 1 for q in r["requests"])) for r in base_runs]
    )
    expected["step_ms"] = s3_step * 1000
    expected["step_cost"] = s3_step / base_step
    # the hand numbers: 160 tok/s over a 105 tok/s baseline, accept 2.5 of a standalone 2.6
    assert expected["speedup"] == pytest.approx(160 / 105)
    assert expected["accept_ratio"] == pytest.approx(2.5 / 2.6)
    rows = report_table.summary_rows(run["records"], make_acceptance(), BENCH)
    got = next(r for r in rows if r["config"] == "s3" and r["concurrency"] == 1)
    from_csv = next(
        r for r in report_table.read_summary(run["paths"]["summary"]) if r["config"] == "s3"
    )
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key
        assert from_csv[key] == pytest.approx(value), f"{key} in summary.csv"
    assert got["verdict"] == from_csv["verdict"] == "ok"
    assert from_csv["baseline_measured_at"] == records["baseline"]["measured_at"]
    assert from_csv["extract_tokens_per_s"] == pytest.approx(812.5)
    baseline = next(r for r in rows if r["config"] == "baseline")
    assert baseline["speedup"] == pytest.approx(1.0) and baseline["verdict"] == "baseline"
    assert baseline["step_cost"] == pytest.approx(1.0)


def test_wiring_mismatch_shows_in_table_markdown_and_plot(run):
    rows = {r["config"]: r for r in report_table.read_summary(run["paths"]["summary"])}
    assert rows["s5"]["verdict"] == MISMATCH
    assert rows["s5"]["accept_ratio"] == pytest.approx(1.15 / 3.0)
    assert rows["s3"]["verdict"] == "ok"
    md = Path(run["paths"]["summary_md"]).read_text()
    s5_line = next(line for line in md.splitlines() if line.startswith("| vllm | s5 |"))
    assert MISMATCH in s5_line
    assert f"**{MISMATCH}** vllm/s5" in md
    # the HTML table the report shows inline: the s5 row highlighted, the verdict explained
    html = run["table"].read_text()
    marked = [row for row in html.split("<tr") if row.startswith(' class="mismatch"')]
    assert len(marked) == 1 and "<td>s5</td>" in marked[0] and MISMATCH in marked[0]
    assert f"<b>{MISMATCH}</b> vllm/s5 (c=1)" in html
    plots = {p["name"]: p for p in run["index"]["plots"]}
    accept = {p["config"]: p for p in plots["accept_length"]["data"]["configs"]}
    assert accept["s5"]["marked"] and accept["s5"]["verdict"] == MISMATCH
    assert accept["s5"]["served"] == pytest.approx(1.15)
    assert accept["s5"]["standalone"] == pytest.approx(3.0)
    assert not accept["s3"]["marked"]
    speed = {b["config"]: b for b in plots["speedup"]["data"]["bars"]}
    assert speed["s5"]["marked"] and not speed["s3"]["marked"]
    # the index on disk says the same as the returned one
    on_disk = json.loads((run["root"] / "plots" / report_plots.INDEX).read_text())
    assert on_disk == json.loads(json.dumps(run["index"]))


def test_same_answers_compares_greedy_first_answers_with_the_baseline():
    """A draft changes the speed, never a greedy answer: the share of prompts whose first-repeat
    answer fingerprint equals the baseline's; sampled rows and the baseline have none."""
    base = {"temperature": 0.0, "answers": {"q1": "a", "q2": "b", "q3": "c"}}
    level = {"temperature": 0.0, "answers": {"q1": "a", "q2": "x", "q3": "c", "q9": "z"}}
    assert report_table.same_answers(level, base) == pytest.approx(2 / 3)
    assert report_table.same_answers({**level, "temperature": 0.7}, base) is None
    assert report_table.same_answers(level, None) is None
    assert report_table.same_answers({"temperature": 0.0}, base) is None


def test_same_answers_from_raw_records(run):
    rows = report_table.summary_rows(run["records"], make_acceptance(), BENCH)
    for row in rows:
        assert row["same_answers"] is None or 0 <= row["same_answers"] <= 1
        if row["config"] == "baseline":
            assert row["same_answers"] is None


def test_settings_line_names_each_measured_level():
    """With `benchmark.runs` the levels carry their own repeats and prompt counts: the line under
    every plot and in the card says those, not the unused top-level `repeats`."""
    cfg = {**BENCH, "repeats": 3, "concurrency": [1]}
    assert report_table.bench_settings(cfg).endswith("3 repeats at concurrency 1")
    runs = [
        {"concurrency": 8, "repeats": 1, "num_prompts": None},
        {"concurrency": 1, "repeats": 2, "num_prompts": 8},
    ]
    line = report_table.bench_settings({**cfg, "runs": runs})
    assert line.endswith("concurrency 8 × 1 repeat; concurrency 1 × 2 repeats on 8 prompts")
    assert "3 repeats" not in line


def test_validation_estimate_beside_the_standalone_check(tmp_path):
    """The trainer's estimate at num_steps = ttt_steps, the standalone figure and their gap,
    per position, in summary.md; no standalone run at ttt_steps says so instead."""
    train = {"best_val": {"full_acc_0": 0.9, "full_acc_1": 0.7, "full_acc_2": 0.5, "loss": 1.0}}
    acceptance = make_acceptance()  # 3 steps: accept length 2.6, rates 0.85, 0.65, 0.45
    cmp = report_table.validation_vs_standalone(train, acceptance)
    assert cmp["ttt_steps"] == 3
    assert cmp["validation"] == pytest.approx(3.1) and cmp["standalone"] == STANDALONE["3"]
    assert cmp["gap"] == pytest.approx(0.5) and cmp["relative_gap"] == pytest.approx(0.5 / 2.6)
    assert [round(r["validation"] - r["standalone"], 6) for r in cmp["per_position"]] == [
        0.05,
        0.05,
        0.05,
    ]
    text = report_table.validation_section(cmp)
    assert "**3.100**" in text and "**2.600**" in text and "+0.500 (+19.2%)" in text
    assert "| 2 | 0.700 | 0.650 | +0.050 |" in text
    # a draft trained for 4 positions, checked at 3 and 5 only: no figure to hold it against
    train4 = {"best_val": {f"full_acc_{i}": 0.5 for i in range(4)}}
    lone = report_table.validation_vs_standalone(train4, acceptance)
    assert lone["standalone"] is None and lone["validation"] == pytest.approx(3.0)
    assert "did not run at num_steps = 4" in report_table.validation_section(lone)
    assert report_table.validation_vs_standalone(None, acceptance) is None
    # a DFlash draft (block 4): its estimate is eal, checked at num_steps = block_size - 1
    block = {
        "draft": {"algorithm": "dflash", "block_size": 4},
        "best_val": {"eal": 2.4, "position_1_acc": 0.8, "position_2_acc": 0.6,
                     "position_3_acc": 0.5, "full_acc": 0.63, "loss": 2.0},
    }  # fmt: skip
    got = report_table.validation_vs_standalone(block, acceptance)
    assert got["ttt_steps"] == 3 and got["validation"] == 2.4 and got["dflash"]
    assert [r["validation"] for r in got["per_position"]] == [0.8, 0.6, 0.5]
    text = report_table.validation_section(got)
    assert "(block_size - 1)" in text and "earlier positions not required" in text
    # summarize writes the section under the table
    paths = {"acceptance": tmp_path / "a.json", "train": tmp_path / "t.json"}
    paths["acceptance"].write_text(json.dumps(acceptance))
    paths["train"].write_text(json.dumps(train))
    report_table.summarize(
        {"records": [], **{k: str(v) for k, v in paths.items()}},
        BENCH,
        str(tmp_path / "s.csv"),
        str(tmp_path / "s.md"),
    )
    assert "### Validation estimate vs standalone check" in (tmp_path / "s.md").read_text()
