"""Hidden-state extraction backends (hf, vllm, sglang), shards behind a manifest."""

from eagleflow.errors import NotImplementedStage


def extract_hidden_states(
    target_json: str, dataset: str, extract_cfg: dict, shard_dir: str, out_manifest: str
) -> None:
    """Capture aux-layer hidden states into shards and write the manifest."""
    raise NotImplementedStage("extract_hidden_states", "issue #4")
