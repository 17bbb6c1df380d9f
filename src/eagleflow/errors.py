"""The exceptions for errors a user can cause (config, data, paths, flags, hosts), one home:
EagleflowError and a subclass per stage that raises it."""


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


class CertificateError(EagleflowError):
    """No certificate, or one that does not cover this target and these layer ids."""


class DiskSpaceError(EagleflowError):
    """Not enough free space for what a stage is about to write."""


class ExportError(EagleflowError):
    """A checkpoint that cannot be exported as it is, or an export that doctor refuses."""


class LayerError(EagleflowError):
    """Layer ids that some consumer cannot capture or would read differently."""


class ManifestError(EagleflowError):
    """A manifest or one of its shards is missing, altered or from another host."""


class RemoteError(EagleflowError):
    """The GPU host cannot be reached, refused a login, or cannot run a job as asked."""
