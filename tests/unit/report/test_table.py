"""The report stage on hand-built raw records: numbers recomputed, mismatch shown, images drawn.

No server and no model: the records below have the exact shape `serve_and_benchmark`,
`check_acceptance`, `train_draft` and `extract_hidden_states` write, with numbers chosen so that
one config is fine (s3) and one is served far below its standalone accept length (s5).
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest

from eagleflow.report import cards as report_cards
from eagleflow.report import plots as report_plots
from eagleflow.report import table as report_table
from eagleflow.serve.bench import MISMATCH
from eagleflow.train.loop import metric_columns

BENCH = {
    "prompt_sets": ["mtbench"],
    "num_prompts": 3,
    "warmup_requests": 1,
    "repeats": 2,
    "max_tokens": 64,
    "concurrency": [1],
    "temperature": 0.0,
    "min_accept_ratio": 0.9,
    "request_timeout_s": 60,
}
REPORT = {"title": "eagleflow test run (synthetic records)", "formats": ["png", "svg"]}
TTT = 3
# config -> (spec, throughput of repeat 0 and 1 at concurrency 1, served accept lengths)
CONFIGS = {
    "baseline": ({"name": "baseline", "num_steps": None, "topk": None}, [100.0, 110.0], None),
    "s3": ({"name": "s3", "num_steps": 3, "topk": 1}, [150.0, 170.0], [2.4, 2.6]),
    "s5": ({"name": "s5", "num_steps": 5, "topk": 1}, [90.0, 95.0], [1.1, 1.2]),
}
STANDALONE = {"3": 2.6, "5": 3.0}  # s5 served 1.15 / 3.0 = 0.38: WIRING MISMATCH?


def _run(conc: int, rep: int, tput: float, accept: float | None) -> dict:
    requests = []
    for i in range(3):
        tokens = 60 + 2 * i
        ttft = 0.05 * (i + 1) + 0.01 * rep
        wall = tokens / tput * conc
        requests.append(
            {
                "id": f"mtbench-{81 + 10 * i}",
                "output_tokens": tokens,
                "wall_s": wall,
                "ttft_s": ttft,
                "decode_tok_s": (tokens - 1) / (wall - ttft),
            }
        )
    tokens = sum(q["output_tokens"] for q in requests)
    wall = tokens / tput
    run = {
        "concurrency": conc,
        "repeat": rep,
        "wall_s": wall,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / wall,
        "requests": requests,
        "accept_length": accept,
    }
    drafts = 50.0 if accept else 0.0
    run["spec"] = {
        "drafts": drafts,
        "draft_tokens": drafts * 3,
        "accepted": (accept - 1) * drafts if accept else 0.0,
        "accept_length": accept,
    }
    return run


def make_records(concurrency=(1,)) -> list[dict]:
    records = []
    for n, (name, (spec, tputs, accepts)) in enumerate(CONFIGS.items()):
        runs = [
            _run(c, rep, tput * c**0.5, accepts[rep] if accepts else None)
            for c in concurrency
            for rep, tput in enumerate(tputs)
        ]
        records.append(
            {
                "engine": "vllm",
                "config": name,
                "spec": spec,
                "draft": None if name == "baseline" else "results/export/speculators",
                "measured_at": f"2026-12-04T10:0{n}:00",
                "benchmark": {**BENCH, "concurrency": list(concurrency)},
                "prompts": ["mtbench-81", "mtbench-91", "mtbench-101"],
                "summary": {"deliberately": "ignored: the report recomputes from runs"},
                "runs": runs,
            }
        )
    return records


def make_acceptance() -> dict:
    by = {}
    for k, al in STANDALONE.items():
        n = int(k)
        rates = [max(0.05, 0.85 - 0.2 * i) for i in range(n)]
        proposed = [200] * n
        by[k] = {
            "num_steps": n,
            "verify_steps": 200,
            "new_tokens": round(al * 200),
            "accept_length": al,
            "proposed_per_position": proposed,
            "accepted_per_position": [round(r * p) for r, p in zip(rates, proposed, strict=True)],
            "acceptance_rate_per_position": rates,
            "per_prompt": [{"id": "mtbench-81", "accept_length": al}],
        }
    return {"draft": "results/export/speculators", "prompts": ["a", "b", "c"], "by_num_steps": by}


def write_metrics(path: Path, val: bool = True, steps: int = 60) -> None:
    rows = []
    for step in range(1, steps + 1):
        row = {"split": "train", "epoch": (step - 1) // 20, "step": step, "lr": 3e-4}
        row.update(tokens=2048, step_ms=400.0 + (step % 5), loss=6.0 - 3.0 * step / steps)
        for i in range(TTT):
            row[f"loss_{i}"] = row["loss"] / TTT
            row[f"full_acc_{i}"] = min(0.9, step / steps * (0.8 - 0.2 * i) + 0.01 * (step % 3))
            row[f"cond_acc_{i}"] = row[f"full_acc_{i}"]
        rows.append(row)
        if val and step % 20 == 0:
            vrow = {"split": "val", "epoch": (step - 1) // 20, "step": step, "loss": row["loss"]}
            vrow.update({f"full_acc_{i}": row[f"full_acc_{i}"] * 0.95 for i in range(TTT)})
            rows.append(vrow)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, metric_columns(TTT), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def make_manifest(tokens_per_s: float | None = 812.5) -> dict:
    return {
        "kind": "hidden_states",
        "host": "testhost",
        "backend": "hf",
        "dtype": "float32",
        "num_samples": 320,
        "num_tokens": 130_000,
        "bytes_per_token": 9216.0,
        "shards": [],
        "run": {
            "host": "testhost",
            "new_tokens": 130_000 if tokens_per_s else 0,
            "seconds": 160.0,
            "tokens_per_s": tokens_per_s,
        },
    }


def make_export(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "README.md").write_text(
        "# EAGLE-3 draft for test-target — speculators format (vLLM)\n\n"
        "Written by eagleflow's `export_draft`.\n\n"
        "## Layers\n\nTrained on aux layers [2, 15, 27].\n"
    )
    (folder / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [2]}))
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 8)


def build(root: Path, records: list[dict], val=True, acceptance=True, tokens_per_s=812.5) -> dict:
    """Write the inputs the report rules read under `root`; the report's input dicts."""
    paths = {}
    bench_dir = root / "bench" / "vllm"
    bench_dir.mkdir(parents=True)
    for rec in records:
        p = bench_dir / f"{rec['config']}.json"
        p.write_text(json.dumps(rec))
        paths.setdefault("records", []).append(str(p))
    if acceptance:
        paths["acceptance"] = str(root / "standalone.json")
        Path(paths["acceptance"]).write_text(json.dumps(make_acceptance()))
    paths["metrics"] = str(root / "metrics.csv")
    write_metrics(Path(paths["metrics"]), val=val)
    paths["manifest"] = str(root / "manifest.json")
    Path(paths["manifest"]).write_text(json.dumps(make_manifest(tokens_per_s)))
    paths["train"] = str(root / "train_summary.json")
    Path(paths["train"]).write_text(
        json.dumps({"steps": 60, "best_val": {"loss": 3.1, "full_acc_0": 0.74}})
    )
    report_table.summarize(
        {k: paths[k] for k in ("records", "acceptance", "train", "manifest") if k in paths},
        BENCH,
        str(root / "summary.csv"),
        str(root / "summary.md"),
    )
    paths["summary"] = str(root / "summary.csv")
    paths["summary_md"] = str(root / "summary.md")
    return paths


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The default-shaped run: one concurrency level, two repeats, all inputs present."""
    root = tmp_path_factory.mktemp("report")
    records = make_records()
    paths = build(root, records)
    inputs = {k: paths[k] for k in ("summary", "acceptance", "metrics", "manifest")}
    table = root / "summary.html"
    index = report_plots.plot_results(inputs, REPORT, str(root / "plots"), BENCH, str(table))
    return {"root": root, "records": records, "paths": paths, "index": index, "table": table}


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
    assert drawn == set(report_plots.PLOTS) - {"throughput_concurrency", "data_size"}
    assert "no data-size study" in plots["data_size"]["no_data"]
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


def _snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).digest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    } | {"__dir_mtime__": folder.stat().st_mtime_ns}


def test_card_has_measured_rows_and_leaves_the_export_alone(run, tmp_path):
    export = tmp_path / "export" / "speculators"
    make_export(export)
    cert = tmp_path / "certificate.json"
    cert.write_text(
        json.dumps({"passed": True, "aux_layers": [2, 15, 27], "target": {"path": "/models/t"}})
    )
    before = _snapshot(export)
    out = tmp_path / "cards" / "test-target-eagle3.md"
    inputs = {"summary": run["paths"]["summary"], "speculators": str(export), "certificate": cert}
    report_cards.write_cards(inputs, REPORT, str(out), BENCH)
    assert _snapshot(export) == before, "write_cards touched the export folder"
    card = out.read_text()
    assert card.startswith((export / "README.md").read_text().rstrip("\n"))
    measured = card.split("## Measured", 1)[1]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in measured.splitlines()}
    assert f"**{MISMATCH}**" in rows["s5"] and "| 1.15 | 3.00 | 0.38 |" in rows["s5"]
    assert "1.52× (1.43–1.62)" in rows["s3"] and "| 2.50 | 2.60 | 0.96 | ok |" in rows["s3"]
    assert "160.0 (150.0–170.0)" in rows["s3"]
    assert "| baseline |" in measured and "2026-12-04T10:01:00" in rows["s3"]
    assert "| max_tokens | 64 |" in measured and "greedy (temperature 0)" in measured
    assert "mtbench, 3 per set" in measured and "aux layers [2, 15, 27]" in measured
    assert f"eagleflow doctor --target /models/t --draft {export} --engine vllm" in measured


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
