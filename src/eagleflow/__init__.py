"""eagleflow: train EAGLE-3 draft models and prove, end to end, that they speed up the target."""

from eagleflow.errors import ConfigError, EagleflowError

__version__ = "0.1.0"
__all__ = ["ConfigError", "EagleflowError", "__version__"]
