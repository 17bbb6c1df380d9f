"""The `eagleflow` command line: checks outside a workflow run (one module per subcommand)."""

from __future__ import annotations

import argparse
import json
import sys

from eagleflow import clean, doctor, engines, layout, smoke
from eagleflow import config as cfg
from eagleflow import layers as lay
from eagleflow.disk import human_bytes
from eagleflow.errors import EagleflowError, RemoteError
from eagleflow.layers import check_layers
from eagleflow.remote import client as remote
from eagleflow.remote import jobs as remote_jobs
from eagleflow.remote import settings as remote_settings
from eagleflow.remote import setup as remote_setup
from eagleflow.remote import watch as remote_watch
from eagleflow.serve import bench
from eagleflow.target.prepare import describe_target, load_target_json

DEFAULT_CONFIG = str(cfg.REPO_ROOT / "config" / "config.yaml")
SGLANG_VERSION = cfg.load_schema()["properties"]["serve"]["properties"]["sglang"]["properties"][
    "version"
]["default"]


def _layers(configfile: list[str]) -> list[str]:
    """An overlay is layered over the embedded default, as `snakemake --configfile` layers it."""
    return [DEFAULT_CONFIG] + [f for f in configfile if f != DEFAULT_CONFIG]


def _cmd_config(args: argparse.Namespace) -> int:
    full = cfg.load_layers(_layers(args.configfile))

    check_layers(full)  # against results/target/target.json where it exists
    print(json.dumps(full, indent=2) if args.show else f"{' '.join(args.configfile)}: valid")
    return 0


def _cmd_serve_command(args: argparse.Namespace) -> int:
    full = cfg.load_layers(_layers(args.configfile))
    engine = full["serve"]["engine"]
    parsers = engines.parser_options(full["serve"])
    failed = False

    def check(cmd: list[str]) -> None:
        nonlocal failed
        problems = engines.vllm_flag_problems(cmd)
        failed = failed or bool(problems)
        verdict = "; ".join(problems) or "ok"
        print(f"# flags parsed by vLLM {engines._vllm_version()}: {verdict}")

    for spec in engines.spec_configs(full):
        draft = None if spec.is_baseline else args.draft
        if engine == "vllm":
            cmd = engines.vllm_command(
                "python",
                args.model,
                spec,
                full["serve"]["vllm"],
                "127.0.0.1",
                8000,
                draft,
                **parsers,
            )
        else:
            cmd = engines.sglang_command(
                "python",
                args.model,
                spec,
                full["serve"]["sglang"],
                "127.0.0.1",
                8000,
                draft,
                **parsers,
            )
        print(f"# {engine} {spec.name}\n{engines.format_command(cmd)}")
        if args.check_flags and engine == "vllm":
            check(cmd)
    ex = full["extract"]
    if ex["mode"] != "offline" and ex["backend"] == "vllm":
        # the capture server a streamed run starts (ids here stand in for the target's plan)
        from eagleflow.extract.vllm_capture import capture_server_command

        ids = [1, 2, 3, 4]
        cmd = capture_server_command(
            "python", args.model, ids, full["serve"]["vllm"], "127.0.0.1", 8000, "STORAGE",
            "bfloat16", cpu=False,
        )  # fmt: skip
        print(f"# vllm capture server (extract.mode {ex['mode']})\n{engines.format_command(cmd)}")
        if args.check_flags:
            check(cmd)
    return 1 if failed else 0


def _cmd_layers(args: argparse.Namespace) -> int:
    target = describe_target(args.target)
    plan = lay.plan_layers(target, args.layers, args.sglang_version, engine=args.engine)
    print(
        f"target {args.target}: {target['num_layers']} decoder layers, hidden "
        f"{target['hidden_size']}, {target['family']} family"
        + (" (ids: the engines' default)" if plan.from_default else "")
    )
    rows = plan.table()
    sglang_head = f"sglang {args.sglang_version} eagle_config"
    head = ["slot", "id", "holds", "speculators", "vllm", sglang_head]
    body = [
        [
            str(r["slot"]),
            r["id"],
            r["holds"],
            str(r["speculators"]),
            str(r["vllm"]),
            str(r["sglang"]),
        ]
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    for line in [head, *body]:
        print("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip())
    ids = plan.engine_ids
    print(f"speculators / vLLM draft config (top-level): {ids['vllm']}")
    print(f"SGLang draft config (eagle_config): {ids['sglang']}")
    for p in plan.sglang.problems:
        print(f"SGLang: {p}")
    for note in plan.sglang.notes:
        print(f"note: {note}")
    real = lay.sglang_capture_real(plan.family, plan.sglang.written, plan.num_layers)
    if real is not None:
        print(f"sglang {real[1]} (installed) captures {lay.format_ids(real[0])}")
    return 0 if not plan.sglang.problems or args.engine == "vllm" else 1


def _cmd_doctor(args: argparse.Namespace) -> int:
    trained = None
    if args.trained_layers:
        parsed = lay.parse_aux_value(args.trained_layers)
        trained = None if parsed == "default" else parsed
    report = doctor.diagnose(
        args.target, args.draft, args.engine, args.server_args, args.sglang_version, trained
    )
    for line in report.info:
        print(f"  {line}")
    for f in sorted(report.findings, key=lambda f: f.verdict != doctor.MISMATCH):
        print(f.line())
    print(report.summary())
    return report.exit_status


def _cmd_remote(args: argparse.Namespace) -> int:
    if args.remote_command == "install-profile":
        link = remote_setup.install_profile(force=args.force)
        print(f"{link} -> {remote_settings.PROFILE_DIR}: `snakemake --profile remote-gpu` uses it")
        return 0
    settings = remote_settings.load_settings(args.settings)
    if args.remote_command == "setup":
        if not args.dry_run:
            try:
                link = remote_setup.install_profile()
                print(f"profile: {link} -> {remote_settings.PROFILE_DIR}")
            except RemoteError as e:  # the host's set-up does not depend on the link
                print(f"note: profile not linked: {e}")
        return remote_setup.setup(settings, dry_run=args.dry_run, bundle=args.bundle)
    if args.remote_command == "check":
        items = remote_setup.check(settings, min_gpus=args.min_gpus)
        for item in items:
            print(item.line())
        bad = [i.name for i in items if not i.ok]
        print(f"{settings.label}: " + ("ready" if not bad else f"missing: {', '.join(bad)}"))
        return 0 if not bad else 1
    if args.remote_command == "logs":
        ans = remote_jobs.logs(settings, args.job, follow=args.follow, out_file=args.out)
        if args.follow:
            print(f"== {ans['job_id']} ended: {ans['state']}", file=sys.stderr)
        return 0
    if args.remote_command == "cancel":
        remote_watch.cancel(args.jobs, settings, run=remote_watch.USER_CANCEL)
        print(f"cancelled on {settings.label}: {' '.join(args.jobs)}")
        return 0
    data_root = _data_root(args.configfile) if not args.no_data_root else None
    ans = remote.list_jobs(settings, last=args.last, data_root=data_root, gpu_use=True)
    print(remote.status_report(ans, settings, running_only=args.running))
    return 0


def _data_root(files: list[str] | None) -> str:
    """The data_root of these config files (the last one naming it wins), default config."""
    import yaml

    root = cfg.load(DEFAULT_CONFIG)["data_root"]
    for extra in files or []:
        with open(extra) as f:
            root = (yaml.safe_load(f) or {}).get("data_root", root)
    return root


def _cmd_clean(args: argparse.Namespace) -> int:
    import yaml

    files = args.configfile or [DEFAULT_CONFIG]
    overrides: dict = {}
    for extra in files[1:]:  # later files layer over earlier ones, as Snakemake's do
        with open(extra) as f:
            overrides = cfg.deep_merge(overrides, yaml.safe_load(f) or {})
    conf = cfg.load(files[0], overrides or None)
    plan = clean.plan(conf, active_s=args.active_minutes * 60)
    print(clean.report(plan))
    if not plan["remove"]:
        return 0
    if not args.yes:
        print("nothing deleted: rerun with --yes to delete the folders marked remove")
        return 0
    print(f"deleted {len(plan['remove'])} folder(s), freed {human_bytes(clean.apply(plan))}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:

    conf = cfg.load(args.configfile)
    settings = {k: v for k, v in conf["benchmark"].items() if k != "endpoints"}
    for key, value in (
        ("prompt_sets", args.prompts),
        ("num_prompts", args.num_prompts),
        ("max_tokens", args.max_tokens),
        ("repeats", args.repeats),
        ("concurrency", args.concurrency),
        ("temperature", args.temperature),
        ("warmup_requests", args.warmup),
    ):
        if value is not None:
            settings[key] = value
    errors = cfg.validation_errors({"benchmark": settings})
    if errors:
        raise EagleflowError("; ".join(e.replace("config key ", "") for e in errors))
    tokenizer, remote_code = args.tokenizer, False
    target_json = layout.path(conf["results_dir"], layout.TARGET)
    if tokenizer is None and target_json.is_file():
        target = load_target_json(str(target_json))
        tokenizer, remote_code = target["path"], bool(target.get("trust_remote_code"))
    if tokenizer is None:
        raise EagleflowError(
            f"no tokenizer: {target_json} does not exist yet; pass --tokenizer with the "
            "target's folder (prompts are rendered with its chat template)"
        )
    endpoint = {
        "name": args.name,
        "url": args.url,
        "engine": args.engine,
        "model": args.model,
        "api_key_env": args.api_key_env,
    }
    out = args.out or str(layout.path(conf["results_dir"], layout.ENDPOINT, endpoint=args.name))
    rec = bench.benchmark_endpoint(tokenizer, endpoint, settings, out, None, remote_code)
    print(f"{args.url} ({args.engine}): {len(rec['prompts'])} prompts; record {out}")
    print("temperature  concurrency  tok/s (min-max)  accept length")
    for s in rec["summary"].values():
        lo, hi = s["throughput_min_max"]
        acc = s["accept_length"]
        print(
            f"{s['temperature']:<11g}  {s['concurrency']:<11d}  "
            f"{s['throughput_tok_s']:.1f} ({lo:.1f}-{hi:.1f})  "
            + (f"{acc:.3f}" if acc is not None else "unknown")
        )
    print("accept length from: " + "; ".join(rec["accept_sources"]))
    if any(r.get("foreign_traffic") for r in rec["runs"]):
        print("warning: other traffic moved the server's counters during the runs (see record)")
    return 0


def _cmd_smoke(args: argparse.Namespace) -> int:
    extra = args.snakemake[1:] if args.snakemake[:1] == ["--"] else args.snakemake
    return smoke.run(args.configfile or [], args.cores, args.profile, extra, args.dry_run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagleflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("config", help="validate a config file (schema and cross-field rules)")
    p.add_argument(
        "--configfile", nargs="+", default=[DEFAULT_CONFIG], help="overlays, in order, as snakemake"
    )
    p.add_argument("--show", action="store_true", help="print the config with defaults filled")
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser("serve-command", help="print the checked launch command of every config")
    p.add_argument("--configfile", nargs="+", default=[DEFAULT_CONFIG], help="overlays, in order")
    p.add_argument("--model", default="TARGET", help="target path to put in the commands")
    p.add_argument("--draft", default="DRAFT", help="draft path to put in the commands")
    p.add_argument(
        "--check-flags",
        action="store_true",
        help="parse each vLLM command with the installed vLLM's own argument parser",
    )
    p.set_defaults(func=_cmd_serve_command)
    p = sub.add_parser("layers", help="layer-id table of a target for every consumer")
    p.add_argument("--target", required=True, help="target folder (only config.json is read)")
    p.add_argument("--layers", default="default", help="aux ids, e.g. embed,3,31 (or default)")
    p.add_argument("--engine", choices=["sglang", "vllm", "speculators"], default="sglang")
    p.add_argument("--sglang-version", default=SGLANG_VERSION, help="release or range")
    p.set_defaults(func=_cmd_layers)
    p = sub.add_parser(
        "doctor",
        help="what a draft and a target disagree on (exit 0 OK, 1 MISMATCH, 3 UNVERIFIED)",
    )
    p.add_argument("--target", required=True, help="target folder (config.json)")
    p.add_argument("--draft", required=True, help="draft folder (speculators or SGLang format)")
    p.add_argument("--engine", choices=["sglang", "vllm"], required=True)
    p.add_argument("--server-args", default="", help="the launch flags, quoted as one string")
    p.add_argument(
        "--sglang-version",
        default=None,
        help="the serving host's release or range (default: every release, each reading named)",
    )
    p.add_argument("--trained-layers", help="ids the draft was trained on, if it does not say")
    p.set_defaults(func=_cmd_doctor)
    p = sub.add_parser("clean", help="list (--yes: delete) bulk data nothing current references")
    p.add_argument(
        "--configfile", action="append", help="config file(s), as given to snakemake (repeatable)"
    )
    p.add_argument("--yes", action="store_true", help="delete the folders listed as remove")
    p.add_argument(
        "--active-minutes",
        type=float,
        default=15,
        help="keep folders written to this recently (a job may be running there; default 15)",
    )
    p.set_defaults(func=_cmd_clean)
    p = sub.add_parser("bench", help="benchmark a server that already runs (nothing started)")
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://host:30000")
    p.add_argument("--engine", choices=["sglang", "vllm"], required=True)
    p.add_argument("--prompts", nargs="+", help="prompt sets (default: the config's)")
    p.add_argument("--num-prompts", type=int, help="prompts per set (default: the config's)")
    p.add_argument("--model", help="served model name (vLLM; default: the server's only one)")
    p.add_argument("--api-key-env", help="environment variable holding the API key")
    p.add_argument("--tokenizer", help="target folder (default: the run's prepared target)")
    p.add_argument("--temperature", type=float, nargs="+", help="one or more temperatures")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--concurrency", type=int, nargs="+")
    p.add_argument("--warmup", type=int, help="warmup requests (default: the config's)")
    p.add_argument("--name", default="cli", help="row name and record file name (default cli)")
    p.add_argument("--out", help="record path (default results/bench/endpoint/NAME.json)")
    p.add_argument("--configfile", default=DEFAULT_CONFIG, help="benchmark settings from here")
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser(
        "smoke", help="the whole chain at a tiny size (config/examples/smoke.yaml): pass or fail"
    )
    p.add_argument("--configfile", nargs="+", help="your config file(s), as given to snakemake")
    p.add_argument("--cores", type=int, default=2, help="snakemake --cores (default 2)")
    p.add_argument("--profile", help="snakemake profile, e.g. remote-gpu")
    p.add_argument("--dry-run", "-n", action="store_true", help="show the jobs, run nothing")
    p.add_argument("snakemake", nargs=argparse.REMAINDER, help="after --: more snakemake arguments")
    p.set_defaults(func=_cmd_smoke)
    p = sub.add_parser("remote", help="the GPU host of `snakemake --profile remote-gpu`")
    rsub = p.add_subparsers(dest="remote_command", required=True)
    settings_help = (
        "settings file (default: profiles/remote-gpu/settings.yaml or $EAGLEFLOW_REMOTE_SETTINGS)"
    )
    r = rsub.add_parser(
        "setup", help="push sources, create the remote venv (gpu-host extra), check"
    )
    r.add_argument("--dry-run", action="store_true", help="print the steps, change nothing")
    r.add_argument("--settings", help=settings_help)
    r.add_argument(
        "--bundle",
        help="a host without a package index: install this offline bundle (make device-bundle)",
    )
    r = rsub.add_parser("check", help="report what the GPU host offers and what is missing")
    r.add_argument("--min-gpus", type=int, default=1, help="GPUs torch must see (default 1)")
    r.add_argument("--settings", help=settings_help)
    r = rsub.add_parser(
        "status", help="jobs on the host (rule, wildcards, times, GPUs), GPU use, data root usage"
    )
    r.add_argument("--last", type=int, default=20, help="how many recent jobs to list")
    r.add_argument("--running", action="store_true", help="only jobs that have not finished")
    r.add_argument(
        "--configfile",
        nargs="+",
        help="config files whose data_root to measure (default: config/config.yaml)",
    )
    r.add_argument("--no-data-root", action="store_true", help="skip the data root's usage")
    r.add_argument("--settings", help=settings_help)
    r = rsub.add_parser("cancel", help="stop remote jobs (their process groups) by id")
    r.add_argument("jobs", nargs="+", metavar="JOBID")
    r.add_argument("--settings", help=settings_help)
    r = rsub.add_parser("logs", help="the remote log of a running or finished job")
    r.add_argument("job", metavar="RULE|JOBID", help="a job id, or a rule (its newest job)")
    r.add_argument("--follow", "-f", action="store_true", help="print new lines until it ends")
    r.add_argument(
        "--out", action="store_true", help="the job's job.out (Snakemake's output on the host)"
    )
    r.add_argument("--settings", help=settings_help)
    r = rsub.add_parser("install-profile", help="link the profile into ~/.config/snakemake")
    r.add_argument("--force", action="store_true", help="replace a file or link already there")
    p.set_defaults(func=_cmd_remote)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EagleflowError as e:
        print(f"eagleflow: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
