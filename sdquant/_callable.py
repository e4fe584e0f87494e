"""`sdquant.calibrate` and `sdquant.export` are both subpackages (the algorithms, the writers) and the
public verbs. Python binds a subpackage as an attribute of its parent once imported, so a plain function
of the same name would be shadowed. Each of the two packages therefore makes its module object callable:
``sdquant.calibrate(model, config, data)`` calls ``sdquant.api.calibrate`` whatever has been imported."""
import sys
import types


def make_callable(module_name: str, verb: str) -> None:
    class _VerbModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            from sdquant import api
            return getattr(api, verb)(*args, **kwargs)

    _VerbModule.__name__ = f"{verb}_module"
    sys.modules[module_name].__class__ = _VerbModule
