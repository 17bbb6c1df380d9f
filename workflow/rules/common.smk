# Helpers shared by every stage: config checks, paths, code hashes, engine selection.
from pathlib import Path

from eagleflow import config as efconfig
from eagleflow import dflash as efdflash
from eagleflow import engines as efengines
from eagleflow import layout
from eagleflow.codehash import code_hash
from eagleflow.errors import EagleflowError
from eagleflow.layers import check_layers
from eagleflow.smoke import smoke_spec
from snakemake.exceptions import WorkflowError

from snakemake.utils import validate

# eagleflow's validator first (one line per problem, naming the dotted key), then Snakemake's
# (fills the schema defaults into `config`), then the cross-field rules JSON Schema cannot express.
try:
    efconfig.raise_for_schema(config)
    validate(config, "../schemas/config.schema.yaml")
    efconfig.check(config)
    check_layers(config)  # once results/target/target.json exists
except EagleflowError as e:
    raise WorkflowError(f"invalid config: {e}") from None

RESULTS = config["results_dir"]
BULK = config["data_root"]
SCRIPTS = Path(workflow.basedir) / "workflow" / "scripts"
SPEC_CONFIGS = efengines.spec_configs(config)
ENGINE = config["serve"]["engine"]
ENDPOINTS = {e["name"]: e for e in config["benchmark"]["endpoints"]}
STREAM = config["extract"]["mode"] != "offline"


def section(name, drop=()):
    """config[name] as a rule's param, without keys the rule does not read (`drop`) and without
    extract.mode while it is offline: keys added after runs existed must not rerun them.
    """
    out = {k: v for k, v in config[name].items() if k not in drop}
    if name == "extract" and out.get("mode") == "offline":
        del out["mode"]
    if name == "extract" and not out.get("gpus"):
        out.pop("gpus", None)
    return out


def stream_source():
    """A vllm stream source's settings (extract.mode online / hybrid, backend vllm): the
    capture server's serve.vllm options, host, start-up limit and GPUs; {} otherwise."""
    if not STREAM or config["extract"]["backend"] != "vllm":
        return {}
    serve = config["serve"]
    return {
        "source": {
            "vllm": serve["vllm"],
            "host": serve["host"],
            "startup_timeout_s": serve["startup_timeout_s"],
            "gpus": config["extract"]["gpus"],
        }
    }


def res(entry, **fields):
    """A path of eagleflow.layout under results_dir (small outputs that travel back from the GPU
    host); Snakemake wildcards in `entry` stay unless `fields` fill them."""
    return str(layout.path(RESULTS, entry, **fields))


def logs(name):
    return res(layout.LOG, name=name)


def bench(name):
    return res(layout.STAGE_TIMES, name=name)


def code(rule_name):
    """sha256 of the rule's script and the eagleflow modules it imports (exact reruns)."""
    return code_hash(SCRIPTS / f"{rule_name}.py")


def init_from_files(wildcards):
    """The init draft's config and weights (train.init_from): an edit reruns what reads them."""
    if not config["train"]["init_from"]:
        return []
    folder = Path(config["train"]["init_from"])
    return [
        str(folder / "config.json"),
        *map(str, sorted(folder.glob("*.safetensors"))),
    ]


def train_params():
    """The train rule's settings: `train`, plus the block draft's when draft.algorithm is dflash
    (an EAGLE-3 run's params, and so its checkpoint key, stay exactly `train`)."""
    if config["draft"]["algorithm"] != "dflash":
        return config["train"]
    return {
        **config["train"],
        "algorithm": "dflash",
        "dflash": config["draft"]["dflash"],
    }


def spec_names():
    return [s.name for s in SPEC_CONFIGS]


def spec_by_name(name):
    return next(s for s in SPEC_CONFIGS if s.name == name)


def draft_export(wildcards):
    """The export an engine serves (none for the baseline)."""
    if wildcards.config == efengines.BASELINE:
        return []
    if efdflash.enabled(config):
        return rules.export_dflash.output.dflash
    return (
        rules.export_draft.output.sglang
        if wildcards.engine == "sglang"
        else rules.export_draft.output.speculators
    )


def eval_answers_input(wildcards):
    """The first turns' answers, where second turns are benchmarked (benchmark.turns: 2)."""
    if int(config["benchmark"].get("turns") or 1) == 2:
        return res(layout.ANSWERS)
    return []


def bench_settings(standalone=False):
    """The benchmark settings without the endpoint list: a managed run (and its baseline)
    reruns when how it is measured changes, not when an endpoint is added; the standalone
    check's batching matters only to the in-process stages (`standalone`)."""
    drop = {"endpoints"} if standalone else {"endpoints", "standalone_batch_size"}
    # unset, standalone_dtype is left out: runs made before the key existed do not rerun
    if not standalone or config["benchmark"].get("standalone_dtype") is None:
        drop.add("standalone_dtype")
    return {k: v for k, v in config["benchmark"].items() if k not in drop}


def endpoint_records():
    return [res(layout.ENDPOINT, endpoint=name) for name in ENDPOINTS]


def baseline_of(name):
    """The endpoints that name `name` as their baseline."""
    return sorted(n for n, e in ENDPOINTS.items() if e.get("baseline") == name)
