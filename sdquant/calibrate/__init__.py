"""Calibration algorithms (rtn, awq, gptq, fp8, joint) and the block walker. Calling this package,
``sdquant.calibrate(model, config, data)``, runs ``sdquant.api.calibrate``."""
from sdquant._callable import make_callable

make_callable(__name__, "calibrate")
