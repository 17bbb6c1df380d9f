"""Standalone acceptance check: EAGLE-3 chain drafting with greedy verification, in-process."""

from eagleflow.errors import NotImplementedStage


def check_acceptance(
    target_json: str, draft: str, bench_cfg: dict, num_steps: list, out: str
) -> None:
    """Standalone EAGLE-3 acceptance (target + draft in-process, no server)."""
    raise NotImplementedStage("check_acceptance", "issue #6")
