"""The workflow as Snakemake sees it: full DAG, rule graph, config errors, exact reruns."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import EAGLEFLOW, copy_workflow, snakemake

ALL_RULES = {
    "prepare_target",
    "prepare_prompts",
    "regenerate",
    "tokenize",
    "extract_hidden_states",
    "verify_layers",
    "vocab_map",
    "train_draft",
    "export_draft",
    "check_acceptance",
    "serve_and_benchmark",
    "summarize",
    "plot_results",
    "write_cards",
    "all",
}

# What each rule's outputs feed, for the embedded default (baseline + s3 + s5), written out by hand
# so that the test does not trust the DAG it checks.
DOWNSTREAM = {
    "prepare_prompts": ["regenerate"],
    "regenerate": ["tokenize"],
    "tokenize": ["extract_hidden_states", "verify_layers", "vocab_map", "train_draft"],
    "extract_hidden_states": ["verify_layers", "train_draft", "summarize", "plot_results"],
    "verify_layers": ["train_draft", "export_draft", "write_cards"],
    "vocab_map": ["train_draft"],
    "train_draft": ["export_draft", "summarize", "plot_results"],
    "export_draft": [
        "check_acceptance",
        "serve_and_benchmark:s3",
        "serve_and_benchmark:s5",
        "write_cards",
    ],
    "check_acceptance": ["summarize", "plot_results"],
    "serve_and_benchmark:s3": ["summarize"],
    "serve_and_benchmark:s5": ["summarize"],
    "serve_and_benchmark:baseline": ["summarize"],
    "summarize": ["plot_results", "write_cards"],
    "plot_results": ["all"],
    "write_cards": ["all"],
}


def closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        job = todo.pop()
        if job not in seen:
            seen.add(job)
            todo += DOWNSTREAM.get(job, [])
    return seen


def scheduled(workdir: Path, *args: str) -> set[str]:
    """Jobs a dry run would execute, as rule, or rule:config for the benchmark jobs."""
    out = snakemake(workdir, "-n", *args).stdout
    jobs = set()
    for block in re.split(r"\n(?=\S*rule \w+:)", out):
        m = re.search(r"^\S*rule (\w+):", block, flags=re.M)
        if m:
            wc = re.search(r"wildcards: .*config=(\w+)", block)
            jobs.add(f"{m.group(1)}:{wc.group(1)}" if wc else m.group(1))
    return jobs


def test_dry_run_lists_every_rule(workflow_copy):
    proc = snakemake(workflow_copy, "-n")
    for rule in ALL_RULES:
        assert re.search(rf"^{rule}\s+\d+$", proc.stdout, flags=re.M), f"{rule} not in the DAG"
    assert re.search(r"^serve_and_benchmark\s+3$", proc.stdout, flags=re.M)  # baseline + 2 specs


def test_rulegraph_renders_every_rule(workflow_copy):
    dot = snakemake(workflow_copy, "--rulegraph").stdout
    assert dot.lstrip().startswith("digraph")
    labels = set(re.findall(r'label = "(\w+)"', dot))
    assert labels == ALL_RULES


def test_bad_config_fails_before_any_job_with_the_key(workflow_copy, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  learning_rate: 0.1\n")
    proc = snakemake(workflow_copy, "-n", "--configfile", str(bad), check=False)
    assert proc.returncode != 0
    assert "unknown config key train.learning_rate" in proc.stdout + proc.stderr
    bad.write_text(
        "serve:\n  engine: sglang\n  speculative:\n"
        "    - {name: x, num_steps: 1, topk: 1, num_draft_tokens: 16}\n"
    )
    proc = snakemake(workflow_copy, "-n", "--configfile", str(bad), check=False)
    assert proc.returncode != 0
    assert "SGLang would silently run with num_draft_tokens=2" in proc.stdout + proc.stderr


SMOLLM2_TARGET = {  # what prepare_target writes for the embedded default (the fields read here)
    "name": "smollm2-135m-instruct",
    "architecture": "LlamaForCausalLM",
    "model_type": "llama",
    "family": "llama",
    "num_layers": 30,
    "hidden_size": 576,
    "vocab_size": 49152,
}


def test_bad_layer_id_fails_right_after_prepare_target(workflow_copy, tmp_path):
    """[embed, 3, 31] on the 30-layer embedded default: no stage before extraction reads the ids,
    yet the run stops at the first stage after prepare_target (regenerate's first act), and once
    target.json exists every later invocation, and `eagleflow config`, refuses before any job."""
    scripts = workflow_copy / "workflow" / "scripts"
    (scripts / "prepare_target.py").write_text(
        f"import json\nopen(snakemake.output.target, 'w').write(json.dumps({SMOLLM2_TARGET!r}))\n"
    )
    (scripts / "prepare_prompts.py").write_text(
        "for out in snakemake.output:\n    open(out, 'w').write('{}')\n"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("extract:\n  aux_layers: [embed, 3, 31]\n")
    assert snakemake(workflow_copy, "-n", "--configfile", str(bad)).returncode == 0  # no target yet
    # the data branch only: the baseline benchmark also follows prepare_target, in an order
    # Snakemake picks (it ran first in one fresh-clone run), and reads no layer id
    target = "results/data/regenerated.jsonl"
    proc = snakemake(workflow_copy, target, "--cores", "1", "--configfile", str(bad), check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "aux layer id 31 does not exist: the target has 30 decoder layers" in out, out
    assert "Error in rule regenerate" in out, out
    done = set(re.findall(r"^Finished jobid: \d+ \(Rule: (\w+)\)", out, flags=re.M))
    assert done == {"prepare_target", "prepare_prompts"}, out
    assert not (workflow_copy / "results" / "data" / "regenerated.jsonl").exists()
    regen_log = (workflow_copy / "results" / "logs" / "regenerate.log").read_text()
    assert "server" not in regen_log.lower() and "extract.aux_layers" in regen_log
    # target.json is there now: refused before any job, by Snakemake and by `eagleflow config`
    proc = snakemake(workflow_copy, "-n", "--configfile", str(bad), check=False)
    assert proc.returncode != 0 and "30 decoder layers" in proc.stdout + proc.stderr
    assert "rule " not in proc.stdout
    cli = subprocess.run(
        [EAGLEFLOW, "config", "--configfile", str(bad)],
        cwd=workflow_copy,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 2 and "aux layer id 31 does not exist" in cli.stderr, cli.stderr


KIMI_EXAMPLE = "config/examples/kimi-k2.5-sglang.yaml"


def _flag(cmd: list[str], name: str) -> str:
    """The value after `name` in a launch command (which must hold it once)."""
    assert cmd.count(name) == 1, f"{name} appears {cmd.count(name)} times in {cmd}"
    return cmd[cmd.index(name) + 1]


def test_kimi_sglang_example_dry_run_and_launch_commands(workflow_copy, tmp_path):
    """The GPU-host example validates and builds the DAG here (target.path exists only on the GPU
    host, and nothing reads it before prepare_target runs), with one SGLang benchmark job per
    spec config, and the launch commands SGLang gets are the ones the example means."""
    import yaml

    from eagleflow import config as cfg
    from eagleflow import engines
    from eagleflow import layers as lay
    from eagleflow.data import regenerate as data_regen
    from eagleflow.target.prepare import describe_target
    from tests.support.tiny import KIMI_K25, config_only

    out = snakemake(workflow_copy, "-n", "--configfile", KIMI_EXAMPLE).stdout
    bench_jobs = set(re.findall(r"wildcards: engine=(\w+), config=(\w+)", out))
    # Snakemake merges the overlay over config/config.yaml exactly like cfg.deep_merge
    base = yaml.safe_load((workflow_copy / "config" / "config.yaml").read_text())
    overlay = yaml.safe_load((workflow_copy / KIMI_EXAMPLE).read_text())
    full = cfg.validate(cfg.deep_merge(base, overlay))
    names = [s.name for s in engines.spec_configs(full)]
    assert names == ["baseline", "s2", "s3", "s5", "s7"]
    assert bench_jobs == {("sglang", n) for n in names}
    assert re.search(rf"^serve_and_benchmark\s+{len(names)}$", out, flags=re.M)
    assert full["extract"]["backend"] == "vllm"  # sglang cannot capture the final slot

    specs = {s.name: s for s in engines.spec_configs(full)}
    model, draft = full["target"]["path"], "/export/sglang"
    for name, steps, draft_tokens in (("s3", "3", "4"), ("s7", "7", "8")):
        cmd = engines.sglang_command(
            "python",
            model,
            specs[name],
            full["serve"]["sglang"],
            "127.0.0.1",
            30000,
            draft,
            **engines.parser_options(full["serve"]),
        )
        assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
        assert _flag(cmd, "--model-path") == "/models/Kimi-K2.5"
        assert _flag(cmd, "--tp-size") == "8"
        assert _flag(cmd, "--speculative-algorithm") == "EAGLE3"
        assert _flag(cmd, "--speculative-draft-model-path") == draft
        assert _flag(cmd, "--speculative-num-steps") == steps
        assert _flag(cmd, "--speculative-eagle-topk") == "1"
        assert _flag(cmd, "--speculative-num-draft-tokens") == draft_tokens
        assert "--trust-remote-code" in cmd
        assert _flag(cmd, "--reasoning-parser") == "kimi_k2"
        assert _flag(cmd, "--tool-call-parser") == "kimi_k2"
    # regeneration's server gets neither parser: the conversations keep Kimi's raw text
    regen = data_regen.regeneration_server(full["serve"], model, full["regenerate"]["engine"], None)
    assert not set(regen.cmd) & {"--reasoning-parser", "--tool-call-parser"}, regen.cmd

    # The aux ids are written [1, 29, 57] for SGLang and read alike by every release either side
    # of the DeepSeek-family rule change (sgl-project/sglang#25454).
    target = describe_target(config_only(tmp_path / "kimi", KIMI_K25))
    plan = lay.plan_layers(target, full["extract"]["aux_layers"], ">=0.5,<0.6")
    assert plan.aux == [2, 30, 58] == lay.default_aux(61)
    assert plan.sglang.rules == {
        lay.RULE_PLUS_ONE: [1, 29, 57],
        lay.RULE_PLUS_ONE_IF_FIRST_1: [1, 29, 57],
    }


STAND_IN = """
# test stand-in: the real imports above (so module hashes count), outputs created below
from pathlib import Path

for out in snakemake.output:
    p = Path(out)
    if p.suffix:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("stand-in")
    else:
        p.mkdir(parents=True, exist_ok=True)
"""


@pytest.fixture(scope="module")
def completed_workflow(tmp_path_factory) -> Path:
    """The real workflow run to completion once, with each script's work replaced by a stand-in
    that keeps the script's imports, so Snakemake records real params (code hashes included)."""
    workdir = copy_workflow(tmp_path_factory.mktemp("completed"))
    for script in (workdir / "workflow" / "scripts").glob("*.py"):
        lines = script.read_text().splitlines()
        imports = [ln for ln in lines if ln.startswith(("from ", "import "))]
        script.write_text("\n".join(imports) + "\n" + STAND_IN)
    snakemake(workdir, "--cores", "2")
    assert scheduled(workdir) == set(), "after a complete run nothing should be left to do"
    return workdir


@pytest.fixture
def completed(completed_workflow, tmp_path) -> Path:
    dest = tmp_path / "wf"
    shutil.copytree(completed_workflow, dest, symlinks=True)
    return dest


def _edit_keep_mtime(path: Path) -> None:
    """A change of what the code does (a new statement), with the file's old mtime kept."""
    st = path.stat()
    path.write_text(path.read_text() + "\n_EDITED = 1\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_comment_and_docstring_edits_in_every_module_rerun_nothing(completed):
    """Every file a rule's hash covers gets a comment and a docstring paragraph (new mtimes
    too): what the code means is unchanged, so a dry run plans no job."""
    files = sorted((completed / "src" / "eagleflow").rglob("*.py"))
    files += sorted((completed / "workflow" / "scripts").glob("*.py"))
    for path in files:
        text = path.read_text()
        if text.startswith('"""'):
            text = text.replace('"""', '"""Edited. ', 1)
        path.write_text("# an edit\n" + text + "\n# another\n")
    assert len(files) > 30
    assert scheduled(completed) == set()


@pytest.mark.parametrize(
    "edited, first",
    [
        ("workflow/scripts/tokenize.py", "tokenize"),
        ("src/eagleflow/serve/acceptance.py", "check_acceptance"),
        ("workflow/scripts/prepare_prompts.py", "prepare_prompts"),
    ],
)
def test_content_edit_with_old_mtime_reruns_exactly_its_stage_and_downstream(
    completed, edited, first
):
    _edit_keep_mtime(completed / edited)
    assert scheduled(completed) == closure(first)


# Modules whose body edits the issue measured (serve, now engines; util, layers, extract_vllm, now
# extract/vllm_capture) and the stage modules beside them, by path under src/eagleflow; the expected
# jobs come from the import graph the hashes follow.
BODY_EDITS = [
    "engines",
    "util",
    "layers",
    "drafts",
    "extract/vllm_capture",
    "serve/acceptance",
    "report/table",
    "report/plots",
    "train/loop",
    "train/settings",
    "train/vocab",
    "data/prompts",
    "data/regenerate",
]
DAG_JOBS = {
    "serve_and_benchmark": [
        "serve_and_benchmark:baseline",
        "serve_and_benchmark:s3",
        "serve_and_benchmark:s5",
    ]
}


@pytest.mark.parametrize("module", BODY_EDITS)
def test_body_edit_of_a_module_reruns_exactly_the_rules_that_import_it(completed, module):
    """A change of behaviour in one module (old mtime kept): exactly the rules whose scripts
    reach it through imports, and what consumes their outputs, and nothing else."""
    from eagleflow import codehash

    expected = set()
    for rule in ALL_RULES - {"all"}:
        deps = codehash.dependencies(completed / "workflow" / "scripts" / f"{rule}.py")
        # deps name the package's own files (codehash follows imports there), by path
        if any(d.as_posix().endswith(f"/src/eagleflow/{module}.py") for d in deps):
            for job in DAG_JOBS.get(rule, [rule]):
                expected |= closure(job)
    _edit_keep_mtime(completed / "src" / "eagleflow" / f"{module}.py")
    got = scheduled(completed)
    RERUNS[module] = len(got - {"all"})
    print(f"RERUNS {module}: {RERUNS[module]} jobs")
    assert got == expected


RERUNS: dict[str, int] = {}


def test_config_change_of_one_stage_reruns_only_it_and_downstream(completed, tmp_path):
    overlay = tmp_path / "o.yaml"
    overlay.write_text("benchmark:\n  repeats: 3\n")
    got = scheduled(completed, "--configfile", str(overlay))
    # benchmark settings: every benchmark job (the baseline too: same conditions), the standalone
    # check (it evaluates the same prompts) and what summarizes them
    assert got == {
        "check_acceptance",
        "serve_and_benchmark:baseline",
        "serve_and_benchmark:s3",
        "serve_and_benchmark:s5",
        "summarize",
        "plot_results",
        "write_cards",
        "all",
    }


def test_standalone_dtype_reruns_the_standalone_check_and_no_served_run(completed, tmp_path):
    """`benchmark.standalone_dtype` is the in-process check's alone: set, it reruns that check and
    the report; unset (the default), it is not in any rule's params, so runs made before the key
    existed do not rerun (the `completed` run planned nothing with it unset)."""
    overlay = tmp_path / "o.yaml"
    overlay.write_text("benchmark:\n  standalone_dtype: bfloat16\n")
    got = scheduled(completed, "--configfile", str(overlay))
    assert got == {"check_acceptance", "summarize", "plot_results", "write_cards", "all"}


def test_user_error_in_a_stage_gives_a_message_not_a_traceback(workflow_copy, tmp_path):
    overlay = tmp_path / "o.yaml"
    missing = tmp_path / "no such model"
    overlay.write_text(f"target:\n  path: '{missing}'\n")
    proc = snakemake(
        workflow_copy, "prepare_target", "--cores", "1", "--configfile", str(overlay), check=False
    )
    assert proc.returncode != 0
    log = (workflow_copy / "results" / "logs" / "prepare_target.log").read_text()
    assert f"target.path {missing} is not a folder" in log and "Traceback" not in log
    assert not (workflow_copy / "results" / "target" / "target.json").exists()
