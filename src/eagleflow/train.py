"""Draft training on speculators: vocab mapping, Trainer wrapper, checkpoints."""

from eagleflow.errors import NotImplementedStage


def build_vocab_map(token_freq: str, draft_vocab_size: int, out_d2t: str, out_t2d: str) -> None:
    """Draft vocabulary (d2t/t2d) from masked-token frequencies."""
    raise NotImplementedStage("vocab_map", "issue #5")


def train_draft(
    inputs: dict, train_cfg: dict, checkpoint_dir: str, out_summary: str, out_metrics: str
) -> None:
    """Train the EAGLE-3 draft with speculators (resumable)."""
    raise NotImplementedStage("train_draft", "issue #5")
