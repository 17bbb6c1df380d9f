"""Target model: build or check the HF folder, describe it in target.json (read as data)."""

from eagleflow.errors import NotImplementedStage


def prepare_target(target_cfg: dict, model_dir: str, out_json: str) -> None:
    """Build or check the target folder and write target.json."""
    raise NotImplementedStage("prepare_target", "issue #3")
