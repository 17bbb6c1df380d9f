"""Look at the HTML report as a person would: build it, screenshot it in headless Chromium.

Run after a workflow run (`make demo`, or any `snakemake` run of this repository):

    .venv/bin/python benchmarks/check_report.py [--results results] [--out DIR] [-- SMK_ARGS...]

(`--workdir DIR` points it at another checkout or a copy of the workflow; default this one.)

It builds `<results>/report.html` with `snakemake --report` (arguments after `--` go to
Snakemake, e.g. the run's `--configfile`), installs Chromium where it is missing
(tests/support/system-deps.sh, Debian package `chromium`), and writes screenshots to `--out`
(default `<results>/report-check`):

    landing.png          the report as it opens (workflow description, rule graph)
    plots.png            the Plots category: one entry per figure
    summary.png          the summary table (summary.html) with its caption
    card.png             the model card's text (the report itself offers it as a download)
    plot-<name>.png      each plot as the report shows it, with its caption beside it

Each screenshot is checked to be non-blank and different from the landing page, and every plot
listed in plots.json must be in the report with a non-empty caption. Then open the PNGs and look:
plots render, captions state the config, nothing is empty, a WIRING MISMATCH? row is visible.
Exit status 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Offline, no display: the virtual time budget lets the report's React app render
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--virtual-time-budget=10000",
]
WINDOW = "1900,1000"  # a 960-px plot beside the report's side bar

# Runs once the report's app has rendered (React renders asynchronously after load).
VIEW_JS = """
<script>
window.addEventListener("load", () => setTimeout(() => {
  const find = (suffix) => Object.keys(results).find((k) => k.endsWith(suffix));
  const view = %s;
  if (view.category) { app.showCategory(view.category); return; }
  const key = find(view.suffix);
  if (!key) { document.body.innerHTML = "<h1>NOT IN REPORT: " + view.suffix + "</h1>"; return; }
  const uri = results[key].data_uri;
  // the report offers non-image, non-HTML files as downloads: show their text instead
  const text = view.content !== "text" ? undefined : new TextDecoder().decode(
    Uint8Array.from(atob(uri.split(",")[1]), (c) => c.charCodeAt(0)));
  app.setView({navbarMode: "resultinfo", resultPath: key, content: view.content,
               contentPath: uri, contentText: text});
}, 1500));
</script>
</body>"""


def chromium() -> str:
    """The chromium binary, installed through tests/support/system-deps.sh where missing."""
    found = shutil.which("chromium")
    if not found:
        print("== chromium is missing; installing it with tests/support/system-deps.sh")
        subprocess.run(["bash", str(REPO / "tests" / "support" / "system-deps.sh")], check=True)
        found = shutil.which("chromium")
    if not found:
        sys.exit("chromium is still not on PATH: install the Debian package `chromium`")
    return found


def build_report(workdir: Path, results: Path, smk_args: list[str]) -> Path:
    html = results / "report.html"
    cmd = [str(BIN / "snakemake"), "--cores", "1", "--report", str(html), *smk_args]
    print("==", " ".join(cmd))
    subprocess.run(cmd, cwd=workdir, check=True)
    return html


def report_results(html: Path) -> dict:
    """The report's `results` object: path -> {caption, data_uri, ...}."""
    m = re.search(r"^\s*var results = (\{.*\});\s*$", html.read_text(), flags=re.M)
    if not m:
        sys.exit(f"{html}: no `var results = {{...}}` found; is it a Snakemake report?")
    return json.loads(m.group(1))


def screenshot(browser: str, page: Path, png: Path, profile: Path) -> None:
    cmd = [
        browser,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        f"--window-size={WINDOW}",
        f"--screenshot={png}",
        page.resolve().as_uri(),
    ]
    # Chromium prints D-Bus errors without a session bus; they are harmless
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    if not png.is_file():
        sys.exit(f"chromium wrote no screenshot {png}")


def pixels_std(png: Path) -> float:
    from matplotlib.image import imread

    return float(imread(png)[..., :3].std())


def same_image(a: Path, b: Path) -> bool:
    from matplotlib.image import imread

    x, y = imread(a), imread(b)
    return x.shape == y.shape and bool((x == y).all())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=str(REPO), help="the workflow's folder (this checkout)")
    ap.add_argument("--results", default="results", help="the run's results_dir (in workdir)")
    ap.add_argument("--out", default=None, help="screenshot folder (<results>/report-check)")
    ap.add_argument("smk_args", nargs="*", help="more Snakemake arguments (after --)")
    args = ap.parse_args()
    workdir = Path(args.workdir).resolve()
    results = (workdir / args.results).resolve()
    out = Path(args.out).resolve() if args.out else results / "report-check"
    out.mkdir(parents=True, exist_ok=True)

    html = build_report(workdir, results, args.smk_args)
    items = report_results(html)
    browser = chromium()
    index_path = results / "plots" / "plots.json"
    plots = json.loads(index_path.read_text())["plots"] if index_path.is_file() else []
    fmt = plots[0]["files"][0].rsplit(".", 1)[1] if plots else "png"

    problems = []
    for p in plots:
        key = next((k for k in items if k.endswith(f"/{p['name']}.{fmt}")), None)
        if key is None:
            problems.append(f"plot {p['name']} is not in the report")
        elif not re.sub(r"<[^>]+>", "", items[key].get("caption") or "").strip():
            problems.append(f"plot {p['name']} has no caption in the report")
    for suffix in ("summary.html", "-eagle3.md"):
        if not any(k.endswith(suffix) for k in items):
            problems.append(f"*{suffix} is not in the report")

    views = {"landing": None, "plots": {"category": "Plots"}}
    views["summary"] = {"suffix": "summary.html", "content": "html"}
    views["card"] = {"suffix": "-eagle3.md", "content": "text"}
    for p in plots:
        views[f"plot-{p['name']}"] = {"suffix": f"/{p['name']}.{fmt}", "content": "img"}
    page_text = html.read_text()
    with tempfile.TemporaryDirectory(prefix="report-check-") as tmp:
        tmp = Path(tmp)
        for name, view in views.items():
            page = html
            if view is not None:
                page = tmp / f"{name}.html"
                # the last </body>: the embedded libraries hold the string too
                head, _, tail = page_text.rpartition("</body>")
                page.write_text(head + VIEW_JS % json.dumps(view) + tail)
            png = out / f"{name}.png"
            screenshot(browser, page, png, tmp / f"profile-{name}")
            std = pixels_std(png)
            blank = std < 0.02
            if blank:
                problems.append(f"{png.name} is blank (pixel std {std:.4f})")
            elif view is not None and same_image(png, out / "landing.png"):
                problems.append(f"{png.name} shows the landing page: the view did not open")
            print(f"  {png}  ({png.stat().st_size // 1024} KB, pixel std {std:.3f})")
    print(f"report: {html} ({html.stat().st_size / 1e6:.1f} MB, {len(items)} items)")
    if problems:
        print("PROBLEMS:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 1
    print(f"all {len(views)} screenshots rendered; now look at them in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
