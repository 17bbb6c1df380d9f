"""Layer-id convention, translations per engine, and the layer certificate."""

from eagleflow.errors import NotImplementedStage


def verify_layers(
    target_json: str,
    dataset: str,
    manifest: str,
    verify_cfg: dict,
    extract_cfg: dict,
    sglang_version: str,
    out: str,
) -> None:
    """Compare stored shards with forward hooks and issue the layer certificate."""
    raise NotImplementedStage("verify_layers", "issue #4")
