"""Draft exports: speculators format (vLLM) and SGLang format, with model cards."""

from eagleflow.errors import NotImplementedStage


def export_draft(
    target_json: str,
    certificate: str,
    summary: str,
    train_cfg: dict,
    target_name: str,
    out_speculators: str,
    out_sglang: str,
) -> None:
    """Write the speculators and SGLang exports of the best checkpoint."""
    raise NotImplementedStage("export_draft", "issue #5")
