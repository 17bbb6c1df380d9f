"""The `eagleflow` command line: checks outside a workflow run (one module per subcommand)."""

from __future__ import annotations

import argparse
import json
import sys

from eagleflow import config as cfg
from eagleflow import serve
from eagleflow.errors import EagleflowError

DEFAULT_CONFIG = str(cfg.REPO_ROOT / "config" / "config.yaml")


def _cmd_config(args: argparse.Namespace) -> int:
    full = cfg.load(args.configfile)
    print(json.dumps(full, indent=2) if args.show else f"{args.configfile}: valid")
    return 0


def _cmd_serve_command(args: argparse.Namespace) -> int:
    full = cfg.load(args.configfile)
    engine = full["serve"]["engine"]
    for spec in serve.spec_configs(full):
        draft = None if spec.is_baseline else args.draft
        if engine == "vllm":
            cmd = serve.vllm_command(
                "python", args.model, spec, full["serve"]["vllm"], "127.0.0.1", 8000, draft
            )
        else:
            cmd = serve.sglang_command(
                "python", args.model, spec, full["serve"]["sglang"], "127.0.0.1", 8000, draft
            )
        print(f"# {engine} {spec.name}\n{serve.format_command(cmd)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagleflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("config", help="validate a config file (schema and cross-field rules)")
    p.add_argument("--configfile", default=DEFAULT_CONFIG)
    p.add_argument("--show", action="store_true", help="print the config with defaults filled")
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser("serve-command", help="print the checked launch command of every config")
    p.add_argument("--configfile", default=DEFAULT_CONFIG)
    p.add_argument("--model", default="TARGET", help="target path to put in the commands")
    p.add_argument("--draft", default="DRAFT", help="draft path to put in the commands")
    p.set_defaults(func=_cmd_serve_command)
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
