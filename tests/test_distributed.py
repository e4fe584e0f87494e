"""Data-parallel calibration with torch.distributed (gloo on CPU): 2 and 4 processes give the same
quantized weights and folded model as 1."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sdquant
from sdquant.config import load_config

IDS = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))


def _cfg(method):
    # fp8 with static activation scales and smoothing: both need statistics reduced across ranks
    return load_config(None, {"model.kind": "builtin", "model.name": "tiny-llama", "quant.method": method,
                              "quant.group_size": 32, "device": "cpu", "pipeline.batch_size": 2,
                              "quant.awq.grid": 4, "quant.awq.clip_grid": 4, "quant.fp8.activations": "static",
                              "quant.fp8.smoothing": True})


def _tensors(res):
    out = {}
    for n, w in res.weights.items():
        for k in ("qweight", "scales", "zeros", "g_idx", "weight", "weight_scale", "input_scale"):
            t = getattr(w, k, None)
            if isinstance(t, torch.Tensor):
                out[f"{n}.{k}"] = t.clone()
    for n, t in res.model.state_dict().items():
        out[f"model.{n}"] = t.clone()
    return out


def _worker(rank, world, port, method, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = sdquant.calibrate(config=_cfg(method), data=IDS)
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in _tensors(res).items()}, f"{path}.rank{rank}")
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world,method,row_tile", [(2, "rtn", None), (2, "gptq", None), (2, "fp8", None),
                                                    (2, "awq+gptq", None), (4, "awq+gptq", None),
                                                    (2, "awq+gptq", 16), (4, "gptq", 16), (3, "awq+gptq", 32)])
def test_data_parallel_equals_single_process(method, world, row_tile, tmp_path, monkeypatch):
    """row_tile: GPTQ's row tile shrunk so the tiny model's linears (64-256 rows) split into units that the
    ranks solve separately (3 ranks: uneven units); the forked workers inherit the patched value."""
    from safetensors.torch import load_file
    from sdquant.calibrate import gptq
    if row_tile is not None:
        monkeypatch.setattr(gptq, "ROW_TILE", row_tile)
    single = _tensors(sdquant.calibrate(config=_cfg(method), data=IDS))
    path = str(tmp_path / "out")
    mp.start_processes(_worker, args=(world, _free_port(), method, path), nprocs=world, join=True,
                       start_method="fork")
    for r in range(world):
        got = load_file(f"{path}.rank{r}")
        assert set(got) == set(single)
        for k, v in single.items():
            assert torch.equal(got[k], v), f"rank {r} of {world}: {k} differs from the single-process run"


def _resume_worker(rank, world, port, work, stage, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if stage == "part":                   # "killed" after block 0
            sdquant.calibrate(config=_cfg("awq+gptq"), data=IDS, work_dir=work, stop_after=1)
        else:
            res = sdquant.calibrate(config=_cfg("awq+gptq"), data=IDS, work_dir=work, resume=True)
            assert res.resumed_blocks == 1
            from safetensors.torch import save_file
            save_file({k: v.contiguous() for k, v in _tensors(res).items()}, f"{path}.rank{rank}")
    finally:
        dist.destroy_process_group()


def test_data_parallel_resume_equals_single_process(tmp_path):
    """Only rank 0 writes the work folder; a 2-rank resume after an interruption, and a one-process resume
    of a 2-rank work folder, both give the uninterrupted one-process result."""
    from safetensors.torch import load_file
    single = _tensors(sdquant.calibrate(config=_cfg("awq+gptq"), data=IDS))
    work = tmp_path / "work"
    mp.start_processes(_resume_worker, args=(2, _free_port(), str(work), "part", None), nprocs=2, join=True,
                       start_method="fork")
    assert len(list(work.glob("block_*.safetensors"))) == 1
    path = str(tmp_path / "out")
    mp.start_processes(_resume_worker, args=(2, _free_port(), str(work), "resume", path), nprocs=2,
                       join=True, start_method="fork")
    for r in range(2):
        got = load_file(f"{path}.rank{r}")
        for k, v in single.items():
            assert torch.equal(got[k], v), f"rank {r}: {k} differs after a data-parallel resume"
    # the same partial folder resumed by one process
    work2 = tmp_path / "work2"
    mp.start_processes(_resume_worker, args=(2, _free_port(), str(work2), "part", None), nprocs=2, join=True,
                       start_method="fork")
    res = sdquant.calibrate(config=_cfg("awq+gptq"), data=IDS, work_dir=work2, resume=True)
    assert res.resumed_blocks == 1
    for k, v in _tensors(res).items():
        assert torch.equal(v, single[k]), k
