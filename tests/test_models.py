"""Adapters for every supported family, on tiny random configurations built with transformers."""
import pytest
import torch
from torch import nn

import sdquant
from sdquant.config import load_config
from sdquant.models.adapters import ADAPTERS, get_adapter, get_blocks, resolve_groups
from sdquant.models.hf import TINY_FAMILIES, convert_conv1d, load_model, tiny_config
from sdquant.config import ModelConfig


def _tiny(family):
    model, tok = load_model(ModelConfig(kind="builtin", name=f"tiny-{family}"))
    return convert_conv1d(model), tok


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_adapter_groups_resolve_and_folding_is_exact(family):
    """Folding a random positive scale into every scaling group leaves the float model's output unchanged."""
    model, _ = _tiny(family)
    adapter = get_adapter(model)
    assert adapter.family == family
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    n_groups = 0
    g = torch.Generator().manual_seed(1)
    for i, block in enumerate(get_blocks(model, adapter)):
        prefix = f"{adapter.blocks}.{i}."
        targets = {prefix + n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
        for grp in resolve_groups(block, prefix, adapter, targets):
            assert grp.linears, grp
            if grp.prev is None:
                continue
            k = grp.linears[0][1].in_features
            grp.fold(torch.rand(k, generator=g) * 1.5 + 0.25)
            n_groups += 1
    assert n_groups >= 2 * len(get_blocks(model, adapter))  # at least the two norm groups per block
    with torch.no_grad():
        out = model(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_rtn_calibrate_export_load_generate(family, tmp_path):
    cfg = load_config(None, {"model.kind": "builtin", "model.name": f"tiny-{family}", "quant.method": "rtn",
                             "quant.group_size": 32, "device": "cpu", "pipeline.batch_size": 2})
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    res = sdquant.calibrate(config=cfg, data=ids)
    n_linear = sum(isinstance(m, nn.Linear) for m in get_blocks(res.model, get_adapter(res.model)).modules())
    assert len(res.weights) == n_linear
    with torch.no_grad():
        fake = res.model(ids).logits
    path = sdquant.export(res, tmp_path / "m.sd2")
    loaded = sdquant.load(path, device="cpu", dtype=torch.float32)
    from sdquant.kernels.linear import QuantLinear
    assert sum(isinstance(m, QuantLinear) for m in loaded.modules()) == n_linear
    with torch.no_grad():
        out = loaded(ids).logits
    # the package computes exactly what calibration's fake-quantized model computed
    torch.testing.assert_close(out, fake, rtol=1e-5, atol=1e-5)
    gen = loaded.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert gen.shape == (1, 7)
    assert loaded.tokenizer is not None


def test_generic_fallback_for_unknown_architecture(caplog):
    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            return x + self.b(torch.relu(self.a(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 32)
            self.layers = nn.ModuleList([Blk(), Blk()])
            self.head = nn.Linear(32, 50)

        def forward(self, input_ids):
            x = self.emb(input_ids)
            for blk in self.layers:
                x = blk(x)
            return self.head(x)

    with caplog.at_level("WARNING"):
        ad = get_adapter(Net())
    assert ad.blocks == "layers" and ad.groups == ()
    assert "generic fallback" in caplog.text and "no AWQ scaling groups" in caplog.text
    net = Net().eval()
    cfg = load_config(None, {"model.kind": "builtin", "model.name": "unused", "quant.method": "rtn",
                             "quant.group_size": 32, "device": "cpu"})
    ids = torch.randint(0, 50, (2, 5))
    res = sdquant.calibrate(net, cfg, ids)
    assert set(res.weights) == {"layers.0.a", "layers.0.b", "layers.1.a", "layers.1.b"}


def test_hf_folder_refuses_pickles(tmp_path):
    from sdquant.errors import ConfigError
    (tmp_path / "config.json").write_text(tiny_config("llama").to_json_string())
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ConfigError, match="no .safetensors weights"):
        load_model(ModelConfig(kind="hf", path=str(tmp_path)))


def test_hf_folder_loads_sharded_safetensors(tmp_path):
    model, _ = _tiny("qwen2")
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    again, _ = load_model(ModelConfig(kind="hf", path=str(tmp_path)))
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits)
