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
