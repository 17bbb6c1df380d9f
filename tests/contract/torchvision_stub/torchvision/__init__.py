"""Import stub for torchvision in the SGLang contract venv (never in the main venv).

PyPI's torchvision cannot load beside the CPU torch ("operator torchvision::nms does not exist"),
yet one import chain of sglang (configs -> nano_nemotron_vl -> multimodal/internvl_utils) imports
`torchvision.transforms`, and transformers then imports more of it. Text models never use it:
every `torchvision.*` module is made on demand and its attributes are MagicMocks.
"""

import importlib.abc
import importlib.machinery
import sys
import types
from unittest.mock import MagicMock

__version__ = "0.0.0+stub"


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return MagicMock(name=f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


__path__ = []
sys.meta_path.insert(0, _StubFinder())
