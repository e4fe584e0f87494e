"""Seedance checkpoints on disk: ``config.json`` + safetensors weights, single-file or sharded.

Folder layout (the Hugging Face convention, so existing tooling can read it):

    config.json                              SeedanceConfig.to_dict()
    model.safetensors                        all tensors                      — or —
    model.safetensors.index.json             {"metadata": {"total_size": n}, "weight_map": {name: shard}}
    model-00001-of-0000N.safetensors ...

Loading is strict: every parameter of the model must be present exactly once with exactly its shape, and
nothing else may be there. Every problem is one ``PackageError`` (or ``ConfigError`` for config.json fields)
naming the file and tensor. Nothing is unpickled: tensors come through safetensors, metadata through json.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sdquant.errors import ConfigError, PackageError
from sdquant.models.seedance import SeedanceConfig, SeedanceDiT

CONFIG_NAME = "config.json"
SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_MAX_LISTED = 5  # names shown in one-line errors


def _names(items) -> str:
    items = sorted(items)
    more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return ", ".join(items[:_MAX_LISTED]) + more


def _atomic_write(path: Path, write) -> None:
    """``write(tmp_path)`` into a temp file in the target folder, then rename over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# ------------------------------------------------------------------------------------------------- config
def read_config(folder: Union[str, Path]) -> SeedanceConfig:
    folder = Path(folder)
    if not folder.is_dir():
        raise PackageError(f"{folder}: not a directory (expected a folder with config.json + safetensors)")
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise PackageError(f"{path}: missing (a Seedance checkpoint folder needs config.json)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PackageError(f"{path}: not valid JSON ({e})") from None
    return SeedanceConfig.from_dict(raw, where=str(path))


# ------------------------------------------------------------------------------------------------ weights
def _weight_files(folder: Path) -> dict:
    """-> {shard file name: [tensor names] or None (= all tensors in that single file)}."""
    single, index = folder / SINGLE_NAME, folder / INDEX_NAME
    if single.is_file() and index.is_file():
        raise PackageError(f"{folder}: both {SINGLE_NAME} and {INDEX_NAME} exist; keep one")
    if single.is_file():
        return {SINGLE_NAME: None}
    if not index.is_file():
        raise PackageError(f"{folder}: no weights ({SINGLE_NAME} or {INDEX_NAME}) found")
    try:
        idx = json.loads(index.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PackageError(f"{index}: not valid JSON ({e})") from None
    wm = idx.get("weight_map") if isinstance(idx, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise PackageError(f"{index}: needs a non-empty object 'weight_map' {{tensor name: shard file}}")
    shards: dict = {}
    for name, shard in wm.items():
        # a shard must be a plain file name in this folder: no paths that could escape it
        if (not isinstance(shard, str) or not shard.endswith(".safetensors") or os.sep in shard or "/" in shard
                or shard.startswith(".")):
            raise PackageError(f"{index}: weight_map[{name!r}] = {shard!r} is not a .safetensors file name "
                               f"in this folder")
        shards.setdefault(shard, []).append(name)
    return shards


def read_state_dict(folder: Union[str, Path], expected: Optional[dict] = None) -> dict:
    """Read all tensors of a checkpoint folder, checking names/shapes against ``expected`` {name: shape}."""
    folder = Path(folder)
    state: dict = {}
    for shard, listed in _weight_files(folder).items():
        path = folder / shard
        if not path.is_file():
            raise PackageError(f"{path}: shard listed in {INDEX_NAME} is missing")
        try:
            f = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error type for corrupt headers
            raise PackageError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
        keys = set(f.keys())
        if listed is not None:
            absent = set(listed) - keys
            if absent:
                raise PackageError(f"{path}: tensors listed in {INDEX_NAME} are not in this shard: {_names(absent)}")
            extra = keys - set(listed)
            if extra:
                raise PackageError(f"{path}: tensors not listed in {INDEX_NAME}: {_names(extra)}")
        for k in sorted(keys):
            if k in state:
                raise PackageError(f"{path}: tensor {k!r} appears in more than one shard")
            if expected is not None and k in expected:
                shape = tuple(f.get_slice(k).get_shape())
                if shape != tuple(expected[k]):
                    raise PackageError(f"{path}: tensor {k!r} has shape {list(shape)}, the config expects "
                                       f"{list(expected[k])}")
            t = f.get_tensor(k)
            if not t.is_floating_point():
                raise PackageError(f"{path}: tensor {k!r} has dtype {t.dtype}, expected a floating-point type")
            state[k] = t
    if expected is not None:
        missing, unexpected = set(expected) - set(state), set(state) - set(expected)
        if missing:
            raise PackageError(f"{folder}: missing {len(missing)} tensor(s): {_names(missing)}")
        if unexpected:
            raise PackageError(f"{folder}: {len(unexpected)} unexpected tensor(s) (wrong config or another "
                               f"model?): {_names(unexpected)}")
    return state


def load_seedance(folder: Union[str, Path], device: Union[str, torch.device] = "cpu",
                  dtype: Optional[torch.dtype] = torch.float32) -> SeedanceDiT:
    """config.json + (sharded) safetensors -> SeedanceDiT in eval mode on ``device``/``dtype``.

    The model is built on the meta device and the loaded tensors are assigned, so no random init is paid
    for. The Cross-Gate Fusion gates stay float32 whatever ``dtype`` is (see CrossGateFusion).
    """
    cfg = read_config(folder)
    with torch.device("meta"):
        model = SeedanceDiT(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state = read_state_dict(folder, expected)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device=device, dtype=dtype if dtype is not None else torch.float32)
    return model.eval()


def save_seedance(model: SeedanceDiT, folder: Union[str, Path], max_shard_bytes: Optional[int] = None,
                  dtype: Optional[torch.dtype] = None) -> Path:
    """Write config.json + weights atomically (each file via temp + rename). ``max_shard_bytes`` splits the
    weights into shards with an index; ``dtype`` stores floating tensors in that type (the CGF gate always
    float32, as the model runs it)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in model.state_dict().items():
        v = v.detach().to("cpu")
        if dtype is not None and ".cgf." not in k:
            v = v.to(dtype)
        state[k] = v.contiguous()
    cfg_text = json.dumps(model.config.to_dict(), indent=2) + "\n"
    _atomic_write(folder / CONFIG_NAME, lambda p: Path(p).write_text(cfg_text, encoding="utf-8"))

    shards: list = [[]]
    size = 0
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        _atomic_write(folder / SINGLE_NAME, lambda p: save_file(state, p, metadata=meta))
        if (folder / INDEX_NAME).exists():
            os.unlink(folder / INDEX_NAME)
        return folder
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        part = {k: state[k] for k in names}
        _atomic_write(folder / fname, lambda p, part=part: save_file(part, p, metadata=meta))
        weight_map.update({k: fname for k in names})
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    _atomic_write(folder / INDEX_NAME, lambda p: Path(p).write_text(index, encoding="utf-8"))
    if (folder / SINGLE_NAME).exists():
        os.unlink(folder / SINGLE_NAME)
    return folder


def load_conditioning(path: Union[str, Path], key: str = "cond", cond_dim: Optional[int] = None) -> torch.Tensor:
    """Conditioning embeddings [M, cond_dim] from a safetensors file (e.g. pooled text embeddings)."""
    path = Path(path)
    if not path.is_file():
        raise PackageError(f"{path}: conditioning file not found")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if key not in f.keys():
                raise PackageError(f"{path}: no tensor {key!r} (has: {_names(f.keys())})")
            c = f.get_tensor(key)
    except PackageError:
        raise
    except Exception as e:
        raise PackageError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    if c.ndim != 2 or c.shape[0] == 0 or not c.is_floating_point():
        raise PackageError(f"{path}: {key!r} must be a non-empty float tensor [M, cond_dim], got "
                           f"{c.dtype} {list(c.shape)}")
    if cond_dim is not None and c.shape[1] != cond_dim:
        raise ConfigError("data.cond_dim", f"{path}: {key!r} has width {c.shape[1]}, the model expects {cond_dim}")
    return c.float()
