import subprocess
import sys


def test_import_touches_no_gpu_and_no_global_setting():
    code = r"""
import torch
before = (torch.get_default_dtype(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
          torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
import os
env_before = dict(os.environ)
import sdquant
from sdquant import config, api  # the public surface
after = (torch.get_default_dtype(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
assert before == after, (before, after)
assert not torch.cuda.is_initialized()
assert dict(os.environ) == env_before
import sys
assert "transformers" not in sys.modules and "triton" not in sys.modules, "heavy imports at import time"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_verbs_are_callable_even_after_subpackages_are_imported():
    import sdquant
    import sdquant.calibrate.pipeline  # noqa: F401  binds the subpackage on sdquant
    import sdquant.export.sd2  # noqa: F401
    assert callable(sdquant.calibrate) and callable(sdquant.export) and callable(sdquant.load)
