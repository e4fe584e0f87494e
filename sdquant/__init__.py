"""sdquant: joint AWQ+GPTQ calibration, INT4/FP8 kernels and a deployable .sd2 package.

Three verbs: ``calibrate``, ``export``, ``load``. Importing sdquant touches no GPU and changes no global
torch setting; heavy modules are imported when a verb is first called.
"""
from __future__ import annotations

__version__ = "0.1.0"

from sdquant.errors import ConfigError, PackageError, SdquantError, ShapeError  # noqa: E402

__all__ = ["calibrate", "export", "load", "compile", "load_config", "Config", "SdquantError", "ConfigError",
           "PackageError", "ShapeError", "__version__"]


def __getattr__(name):
    # lazy: keeps `import sdquant` cheap and free of side effects
    if name in ("calibrate", "export"):  # callable subpackages, see sdquant/_callable.py
        import importlib
        return importlib.import_module(f"sdquant.{name}")
    if name in ("load", "compile"):
        from sdquant import api
        return getattr(api, name)
    if name in ("load_config", "Config"):
        from sdquant import config
        return getattr(config, name)
    raise AttributeError(f"module 'sdquant' has no attribute {name!r}")
