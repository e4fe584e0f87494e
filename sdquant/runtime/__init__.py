"""A lean gpt-fast-style decoder runtime for Llama-family models (static KV cache, fused qkv and gate/up
linears, torch.compile + CUDA graphs for decode). Built from a HF model (float or quantized) or from random
weights of a given shape (benchmarks). See ``sdquant.runtime.model``."""
from sdquant.runtime.spec import SUPPORTED_FAMILIES, DecoderDims, DecoderSpec, decoder_spec  # noqa: F401
