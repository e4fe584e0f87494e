"""torch.compile lowering of (quantized) models: ``sdquant.compile(model, mode=..., fullgraph=True)``.

QuantLinear / Fp8Linear call torch.library ops that have fake implementations, so dynamo traces straight
through them: a quantized model compiles with ``fullgraph=True`` (no graph break per layer), and
``mode="reduce-overhead"`` replays each decode step as a CUDA graph. Decoding needs a static KV cache for
that (fixed shapes, in-place cache writes):

- an sdquant runtime ``Transformer`` (``sdquant.runtime.model``) has one built in; ``compile`` compiles its
  decode step (``scope="model"``: one graph for the whole forward; ``scope="block"``: one compiled block
  reused by every layer — seconds to compile instead of minutes, used with ``CUDAGraphStep``);
- a Hugging Face causal LM is switched to transformers' StaticCache and its ``generate`` compiles the decode
  step with our settings (transformers' own compile hook, configured through ``CompileConfig``);
- any other module is passed to ``torch.compile`` unchanged.

Nothing here changes a global torch setting (inductor's programmatic dependent launch, on by default for the
runtime on Hopper, goes in as this compile's options).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sdquant.errors import ConfigError

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile(model: nn.Module, mode: Optional[str] = "reduce-overhead", fullgraph: bool = True,  # noqa: A001
            backend: str = "inductor", dynamic: Optional[bool] = False, scope: str = "model",
            compile_on_cpu: bool = True, pdl: Optional[bool] = None) -> nn.Module:
    """Compile ``model`` for fast decoding; returns the model (HF / runtime) or the compiled module.

    mode: torch.compile mode ("reduce-overhead" = CUDA graphs on a GPU); ignored by non-inductor backends.
    backend: "inductor" (default), or "aot_eager"/"eager" for quick checks and CI.
    scope: for the sdquant runtime only ("model" or "block", see module doc).
    compile_on_cpu: let transformers' generate compile on a CPU too (it only does on accelerators otherwise).
    pdl: for the sdquant runtime only: programmatic dependent launch (``Transformer.compile_decode``; None = on
        where it can run).
    """
    if mode not in MODES:
        raise ConfigError("mode", f"must be one of {', '.join(str(m) for m in MODES)}, got {mode!r}")
    if not isinstance(fullgraph, bool):
        raise ConfigError("fullgraph", f"must be true or false, got {fullgraph!r}")
    if backend != "inductor":
        mode = None   # modes are inductor options
    from sdquant.runtime.model import Transformer
    if isinstance(model, Transformer):
        return model.compile_decode(mode=mode, fullgraph=fullgraph, backend=backend, scope=scope,
                                    dynamic=bool(dynamic), pdl=pdl)
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None and hasattr(model, "generate"):
        from transformers import CompileConfig
        gen_cfg.cache_implementation = "static"
        cc = CompileConfig(fullgraph=fullgraph, dynamic=dynamic, backend=backend,
                           mode=mode if mode is not None else "default")
        if mode is None:
            # CompileConfig always forwards `mode`; non-inductor backends reject it, so send options instead
            cc.mode = None
        cc._compile_all_devices = compile_on_cpu
        gen_cfg.compile_config = cc
        gen_cfg.disable_compile = False
        return model
    kwargs = {"fullgraph": fullgraph, "backend": backend, "dynamic": dynamic}
    if mode is not None:
        kwargs["mode"] = mode
    return torch.compile(model, **kwargs)
