"""The one exception type for errors a user can cause (config, data, paths, flags, hosts)."""


class EagleflowError(Exception):
    """A user-fixable error; its message names the value, what was expected, and the fix."""


class ConfigError(EagleflowError):
    """The configuration is invalid."""


class NotImplementedStage(EagleflowError):
    """A declared stage whose implementation belongs to a later issue."""

    def __init__(self, stage: str, issue: str):
        super().__init__(
            f"stage '{stage}' is declared in the workflow but not implemented yet ({issue}). "
            f"Run the stages before it with `snakemake --until {stage} -n` to see what exists."
        )


class TrainError(EagleflowError):
    """Training inputs or settings that cannot produce a draft."""


class TrainingInterrupted(EagleflowError):
    """SIGTERM/SIGINT stopped training after a checkpoint was saved; rerun to resume."""
