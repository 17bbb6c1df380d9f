"""DFlash (block drafts): what differs from EAGLE-3 in how the target's layers are named.

Kept apart from `eagleflow.layers`, which every EAGLE-3 rule imports: a DFlash addition here
changes no EAGLE-3 rule's code hash (`eagleflow.codehash`), so it reruns nothing of theirs.

The same layers, a second convention: speculators' `aux_hidden_state_layer_ids` and
vLLM's `eagle_aux_hidden_state_layer_ids` are eagleflow ids (k: the input of layer k); a native
`dflash_config.target_layer_ids` (z-lab's format, vLLM's DFlashDraftModel, SGLang's DFLASH)
names the *output* of layer t, so t = k - 1. vLLM's speculators adapter writes k - 1 and its
runners read t + 1; SGLang captures "before layer t + 1" (tests/contract hold each to its code).
"""

from __future__ import annotations

from eagleflow.layers import default_aux, format_ids, parse_aux_value

ALGORITHM = "dflash"  # draft.algorithm, and speculators' speculators_model_type
NATIVE_ARCHITECTURE = "DFlashDraftModel"  # a native (z-lab) folder's architectures


def dflash_target_layer_ids(ids: list[int]) -> list[int]:
    """`dflash_config.target_layer_ids` for eagleflow ids: the output of layer k - 1."""
    return [k - 1 for k in ids]


def ids_from_dflash_target_layer_ids(target_layer_ids: list[int]) -> list[int]:
    """eagleflow ids a native `dflash_config.target_layer_ids` names (vLLM and SGLang: t + 1)."""
    return [t + 1 for t in target_layer_ids]


def dflash_problems(ids: list[int], num_layers: int) -> list[str]:
    """What keeps `ids` from being one DFlash draft's layers for every consumer: SGLang takes
    0 <= t < num_layers and captures before layer t + 1, so the embedding (k = 0) and the
    final layer's output (k = num_layers, the final slot already) are out."""
    problems = []
    if len(set(ids)) != len(ids) or list(ids) != sorted(ids):
        problems.append(f"DFlash layer ids {format_ids(ids)} must be distinct and ascending")
    for k in ids:
        if k <= 0 or k >= num_layers:
            problems.append(
                f"DFlash layer id {k} is outside 1..{num_layers - 1}: SGLang's DFLASH reads "
                f"target_layer_ids t = id - 1 = {k - 1} with 0 <= t < {num_layers} and captures "
                f"before layer t + 1 (id 0, the embedding, and id {num_layers}, the final slot, "
                "cannot be a DFlash layer); use e.g. "
                f"{format_ids(default_aux(num_layers))}"
            )
    return problems


def enabled(config: dict) -> bool:
    """`draft.algorithm` is dflash."""
    return config.get("draft", {}).get("algorithm", "eagle3") == ALGORITHM


def config_problems(config: dict) -> list[str]:
    """A DFlash config's problems visible without the target (config.check)."""
    if not enabled(config):
        return []
    d = config["draft"]["dflash"]
    problems = []
    if d["per_position_loss_weight"] == "dpace" and d["loss_fn"] != "ce":
        problems.append(
            f"draft.dflash.per_position_loss_weight dpace weighs positions by the target's "
            f"confidence in its greedy token and needs draft.dflash.loss_fn ce, not "
            f"{d['loss_fn']!r}: set loss_fn: ce, or per_position_loss_weight: fixed-exp-decay"
        )
    most = int(d["block_size"]) - 1
    for item in config["serve"]["speculative"]:
        steps, topk = item.get("num_steps"), item.get("topk")
        if steps is not None and steps > most:
            problems.append(
                f"serve.speculative {item['name']}: num_steps {steps} exceeds what one DFlash "
                f"block proposes (draft.dflash.block_size {d['block_size']} - 1 = {most}): use "
                f"num_steps <= {most}, or a larger block_size"
            )
        if topk not in (None, 1):
            problems.append(
                f"serve.speculative {item['name']}: topk {topk}; a DFlash block is one chain "
                "(the engines serve it with topk 1): set topk: 1"
            )
    ids = parse_aux_value(config["extract"]["aux_layers"])
    if ids != "default" and any(k <= 0 for k in ids):
        problems.append(
            f"extract.aux_layers {format_ids(ids)} holds id 0 (the embedding output), which a "
            "DFlash draft cannot read (SGLang's DFLASH takes target_layer_ids t = id - 1 >= 0): "
            "use ids from 1 up, e.g. 'default'"
        )
    if config["extract"].get("mode", "offline") != "offline":
        problems.append(
            f"extract.mode {config['extract']['mode']}: DFlash drafts train from stored shards "
            "for now (streaming feeds EAGLE-3 only): set extract.mode: offline"
        )
    if config["serve"]["engine"] != "vllm":
        problems.append(
            f"serve.engine {config['serve']['engine']}: eagleflow serves DFlash drafts on vLLM "
            "so far (SGLang's DFLASH reads the same export but is not wired yet): set "
            "serve.engine: vllm"
        )
    if config["train"].get("loss_implementation") == "fused":
        problems.append(
            "train.loss_implementation fused is speculators' EAGLE-3 kernel; a DFlash draft "
            "trains with the eager loss: set train.loss_implementation: eager"
        )
    if config["train"].get("init_from"):
        problems.append(
            "train.init_from fine-tunes an EAGLE-3 draft; draft.algorithm dflash trains a fresh "
            "block draft: set train.init_from: null"
        )
    return problems
