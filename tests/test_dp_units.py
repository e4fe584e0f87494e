"""Pieces of data-parallel calibration that need no process group: the deterministic task assignment, the
AWQ waves (which scaling groups may be searched before any of them is folded), and the exactness of
searching a wave before folding it."""
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from sdquant.calibrate.awq_search import AwqJob, awq_waves
from sdquant.calibrate.distributed import SINGLE, Dist, lpt_assign
from sdquant.models.adapters import ADAPTERS, ScalingGroup, resolve_groups


def test_lpt_assign_is_deterministic_and_balanced():
    costs = [5, 1, 1, 1, 1, 1, 4, 2]
    a = lpt_assign(costs, 2)
    assert a == lpt_assign(costs, 2)
    loads = [sum(c for c, o in zip(costs, a) if o == r) for r in range(2)]
    assert sorted(loads) == [8, 8]
    assert lpt_assign(costs, 1) == [0] * len(costs)
    assert set(lpt_assign([1.0] * 10, 4)) == {0, 1, 2, 3}


def test_single_process_dist_is_inactive():
    assert not SINGLE.active and SINGLE.is_main
    assert Dist(1, 4).shard(list(range(10))) == [1, 5, 9]
    assert SINGLE.all_gather_tree({"x": torch.ones(2)})[0]["x"].sum() == 2


def _llama_jobs():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1)
    block = LlamaDecoderLayer(cfg, 0)
    prefix = "model.layers.0."
    targets = {prefix + n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    groups = resolve_groups(block, prefix, ADAPTERS["llama"], targets)
    return [AwqJob(i, g, [n for n, _ in g.linears], [m for _, m in g.linears], None, False)
            for i, g in enumerate(groups)]


def test_decoder_block_is_one_wave():
    jobs = _llama_jobs()      # norm→qkv, norm→gate/up, up→down (v→o is dropped under GQA: v is narrower than o)
    assert len(jobs) == 3
    assert [len(w) for w in awq_waves(jobs)] == [3]


def test_a_group_reading_an_earlier_fold_starts_a_new_wave():
    # group B's search reads the linear that group A's fold rescales (A's consumer is B's inspect module)
    a_prev, a_lin, b_lin = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)
    inspect_b = nn.Sequential(a_lin, b_lin)
    ga = ScalingGroup(a_prev, "norm", [("a", a_lin)], a_lin, "a")
    gb = ScalingGroup(None, None, [("b", b_lin)], inspect_b, "seq")
    jobs = [AwqJob(0, ga, ["a"], [a_lin], None, False), AwqJob(1, gb, ["b"], [b_lin], None, False)]
    assert [len(w) for w in awq_waves(jobs)] == [1, 1]
    # ...but not when the order is reversed (a later fold never changes an earlier search)
    assert [len(w) for w in awq_waves(jobs[::-1])] == [2]


def test_wave_search_equals_group_by_group_search(monkeypatch):
    """Searching every group of a wave before folding any gives bitwise the weights of searching and folding
    one group at a time (the sequential algorithm)."""
    import sdquant
    from sdquant.calibrate import recipes
    from sdquant.config import load_config
    cfg = load_config(None, {"model.kind": "builtin", "model.name": "tiny-llama", "quant.method": "awq+gptq",
                             "quant.group_size": 32, "device": "cpu", "pipeline.batch_size": 2,
                             "quant.awq.grid": 4})
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    waves = sdquant.calibrate(config=cfg, data=ids)
    monkeypatch.setattr(recipes, "_awq_waves", lambda jobs: [[j] for j in jobs])
    one_by_one = sdquant.calibrate(config=cfg, data=ids)
    assert set(waves.weights) == set(one_by_one.weights)
    for n, w in waves.weights.items():
        assert torch.equal(w.qweight, one_by_one.weights[n].qweight), n
        assert torch.equal(w.scales, one_by_one.weights[n].scales), n
