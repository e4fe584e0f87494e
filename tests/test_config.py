"""Every invalid config is a one-line ConfigError naming the field path."""
import pytest
import yaml

from sdquant.config import Config, layer_spec, load_config
from sdquant.errors import ConfigError

BASE = {"model.kind": "builtin", "model.name": "tiny-llama"}

BAD = [
    ({"quant.bitz": 4}, "quant.bitz", "did you mean 'bits'"),
    ({"qaunt.bits": 4}, "qaunt", "did you mean 'quant'"),
    ({"quant.bits": 5}, "quant.bits", "not supported"),
    ({"quant.bits": "four"}, "quant.bits", "expected an integer"),
    ({"quant.bits": True}, "quant.bits", "expected an integer"),
    ({"quant.method": "gtpq"}, "quant.method", "did you mean 'gptq'"),
    ({"quant.group_size": 12}, "quant.group_size", "multiple of 8"),
    ({"quant.symmetric": "yes"}, "quant.symmetric", "true or false"),
    ({"quant.damp": 0}, "quant.damp", "(0, 1]"),
    ({"quant.damp": 2.0}, "quant.damp", "(0, 1]"),
    ({"quant.act_order": "dynamic"}, "quant.act_order", "not one of"),
    ({"quant.act_order": "group", "quant.method": "rtn"}, "quant.act_order", "GPTQ"),
    ({"quant.activation_scaling.ratio_range": [0.5, 1.2]}, "quant.activation_scaling.ratio_range", "outside the allowed"),
    ({"quant.activation_scaling.ratio_range": [0.9, 1.3]}, "quant.activation_scaling.ratio_range", "outside the allowed"),
    ({"quant.activation_scaling.ratio_range": [1.1, 0.9]}, "quant.activation_scaling.ratio_range", "empty"),
    ({"quant.activation_scaling.ratio_range": [0.9]}, "quant.activation_scaling.ratio_range", "list of 2"),
    ({"quant.activation_scaling.init_ratio": 1.15, "quant.activation_scaling.ratio_range": [0.8, 1.1]},
     "quant.activation_scaling.init_ratio", "outside ratio_range"),
    ({"quant.activation_scaling.granularity": 48, "quant.group_size": 64},
     "quant.activation_scaling.granularity", "does not line up with quant.group_size 64"),
    ({"quant.awq.grid": 0}, "quant.awq.grid", ">= 1"),
    ({"quant.awq.clip_max_shrink": 1.5}, "quant.awq.clip_max_shrink", "(0, 1)"),
    ({"quant.fp8.activations": "tensor"}, "quant.fp8.activations", "not one of"),
    ({"quant.fp8.weights": "group"}, "quant.fp8.weights", "not one of"),
    ({"quant.fp8.smooth_alpha": 2}, "quant.fp8.smooth_alpha", "[0, 1]"),
    ({"quant.ignore": ["(unclosed"]}, "quant.ignore[0]", "invalid regular expression"),
    ({"quant.ignore": "lm_head"}, "quant.ignore", "expected a list"),
    ({"quant.overrides": [{"bits": 8}]}, "quant.overrides[0].pattern", "required"),
    ({"quant.overrides": [{"pattern": "down", "bits": 6}]}, "quant.overrides[0].bits", "not supported"),
    ({"quant.overrides": [{"pattern": "down", "bitz": 8}]}, "quant.overrides[0].bitz", "unknown key"),
    ({"data.n_samples": 0}, "data.n_samples", ">= 1"),
    ({"data.kind": "jsonl"}, "data.path", "required"),
    ({"data.kind": "text", "data.path": "/nonexistent/file.txt"}, "data.path", "not found"),
    ({"model.kind": "hf", "model.path": "/nonexistent/model"}, "model.path", "not found"),
    ({"model.kind": "builtin", "model.name": None}, "model.name", "required"),
    ({"device": "gpu0"}, "device", "is not a device"),
    ({"dtype": "fp16"}, "dtype", "not one of"),
    ({"pipeline.batch_size": -1}, "pipeline.batch_size", ">= 1"),
    ({"pipeline.offload": "disk"}, "pipeline.offload", "not one of"),
    ({"quant": 4}, "quant", "expected a mapping"),
]


@pytest.mark.parametrize("over,field,text", BAD, ids=[b[1] + ":" + b[2][:12] for b in BAD])
def test_invalid_config_names_field(over, field, text):
    with pytest.raises(ConfigError) as ei:
        load_config(None, {**BASE, **over})
    msg = str(ei.value)
    assert msg.startswith(field + ":"), msg
    assert text in msg
    assert "\n" not in msg


def test_defaults_and_yaml_roundtrip(tmp_path):
    cfg = load_config(None, BASE)
    assert cfg.quant.activation_scaling.ratio_range == (0.8, 1.2)
    assert cfg.quant.activation_scaling.init_ratio == 1.0
    p = tmp_path / "c.yaml"
    p.write_text(cfg.to_yaml())
    again = load_config(p)
    assert again == cfg
    with pytest.raises(Exception):
        again.quant.bits = 3  # frozen


def test_set_overrides_parse_yaml_scalars():
    cfg = load_config(None, [*(f"{k}={v}" for k, v in BASE.items()), "quant.bits=3",
                             "quant.activation_scaling.ratio_range=[0.9, 1.1]", "quant.symmetric=true"])
    assert cfg.quant.bits == 3 and cfg.quant.symmetric is True
    assert cfg.quant.activation_scaling.ratio_range == (0.9, 1.1)
    with pytest.raises(ConfigError, match=r"^--set: expected key.path=value"):
        load_config(None, ["quant.bits"])


def test_missing_and_broken_config_files(tmp_path):
    with pytest.raises(ConfigError, match="^--config: file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("quant: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(lst)


def test_layer_spec_ignore_and_overrides():
    cfg = load_config(None, {**BASE, "quant.ignore": ["o_proj"], "quant.overrides": [
        {"pattern": r"down_proj", "bits": 8, "group_size": 32},
        {"pattern": r"layers\.1\.mlp\.down_proj", "method": "keep"}]})
    q = cfg.quant
    assert layer_spec(q, "model.layers.0.self_attn.o_proj") is None
    assert layer_spec(q, "lm_head", (r"lm_head$",)) is None
    s = layer_spec(q, "model.layers.0.mlp.down_proj")
    assert (s.bits, s.group_size, s.source) == (8, 32, "quant.overrides[0].group_size")
    assert layer_spec(q, "model.layers.1.mlp.down_proj") is None
    assert layer_spec(q, "model.layers.0.mlp.up_proj").bits == 4


def test_group_size_not_dividing_a_layer_names_the_layer():
    import sdquant
    import torch
    cfg = load_config(None, {**BASE, "quant.method": "rtn", "quant.group_size": 48, "device": "cpu"})
    with pytest.raises(ConfigError, match=r"^quant.group_size: 48 does not divide in_features 64 of layer "
                                          r"model\.layers\.0\.self_attn\.q_proj"):
        sdquant.calibrate(config=cfg, data=torch.randint(0, 256, (2, 16)))


def test_every_template_parses_and_validates(repo, tmp_path):
    """Templates point at user paths; validate each with those paths redirected to real files."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    text = tmp_path / "calib.txt"
    text.write_text("hello world " * 100)
    seen = 0
    for t in sorted((repo / "templates").glob("*.yaml")):
        raw = yaml.safe_load(t.read_text())
        over = {}
        if raw.get("model", {}).get("path"):
            over["model.path"] = str(model_dir)
        if raw.get("data", {}).get("path"):
            over["data.path"] = str(text)
        if raw.get("model", {}).get("kind") == "seedance":
            continue  # validated against a real Seedance folder in tests/models
        cfg = load_config(t, over)
        assert isinstance(cfg, Config)
        seen += 1
    assert seen >= 8
