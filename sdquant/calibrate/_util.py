"""Small helpers shared by the calibration recipes."""
from __future__ import annotations


def cfg(obj, path: str, default=None):
    """Read a dotted config field with a default (fields added later by the lead read the same way)."""
    cur = obj
    for part in path.split("."):
        if cur is None:
            return default
        cur = cur.get(part, None) if isinstance(cur, dict) else getattr(cur, part, None)
    return default if cur is None else cur


def out_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def map_leaves(fn, obj):
    """fn applied to every leaf of nested tuples / lists / dicts (module call arguments), the containers
    rebuilt as plain tuples, lists and dicts; fn sees every non-container value, tensors or not."""
    if isinstance(obj, tuple):
        return tuple(map_leaves(fn, o) for o in obj)
    if isinstance(obj, list):
        return [map_leaves(fn, o) for o in obj]
    if isinstance(obj, dict):
        return {k: map_leaves(fn, v) for k, v in obj.items()}
    return fn(obj)
