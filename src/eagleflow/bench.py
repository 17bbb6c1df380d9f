"""Benchmark client and metrics (accept length from the engine itself)."""

from eagleflow.errors import NotImplementedStage


def serve_and_benchmark(
    target_json: str, draft: str | None, serve_cfg: dict, bench_cfg: dict, spec: dict, out: str
) -> None:
    """Start the engine for one config, benchmark it, stop it."""
    raise NotImplementedStage("serve_and_benchmark", "issue #6")
