"""RoPE types whose table depends on the current sequence length cannot be one fixed table: refused by name."""
import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from sdquant.runtime.spec import UnsupportedModelError, decoder_spec


def _model(rope):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, rope_scaling=rope)
    return LlamaForCausalLM(cfg)


def test_dynamic_rope_refused_with_field_name():
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic'"):
        decoder_spec(_model({"rope_type": "dynamic", "factor": 2.0}))


def test_static_rope_types_accepted():
    assert decoder_spec(_model({"rope_type": "linear", "factor": 2.0})).dims is not None
    assert decoder_spec(_model(None)).dims is not None
