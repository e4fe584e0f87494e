"""Joint AWQ+GPTQ in the right coordinates.

After AWQ folds a scale s [K] into the op that produces a group's input, the group's linears see x' = x / s
and hold W' = W · s. GPTQ must then minimise the output error *in those coordinates*, i.e. use the Hessian of
the scaled inputs:

    H' = 2/T · x'ᵀx' = diag(1/s) · H · diag(1/s)

Quantizing W · s against the unscaled H (what two public toolchains did) weights the rounding errors of the
wrong channels: a channel that AWQ scaled up by s_k (because its activations are large) is *over*-penalised
by s_k², so GPTQ spends its error budget exactly where AWQ already protected the weights.

Pure functions; the recipe either re-captures H after folding or transforms it with ``scale_hessian``.
"""
from __future__ import annotations

import torch

from sdquant.calibrate.gptq import gptq_quantize


def scale_hessian(H: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """H [K, K] of inputs x -> Hessian of inputs x / s: diag(1/s) H diag(1/s) (float32, new tensor)."""
    inv = 1.0 / s.float()
    return H.float() * inv[:, None] * inv[None, :]


def joint_quantize(W: torch.Tensor, H: torch.Tensor, s: torch.Tensor, **gptq_kwargs):
    """GPTQ of the AWQ-scaled weight W · s [N, K] against the Hessian of the scaled inputs.

    H is the Hessian of the *unscaled* inputs. Returns gptq_quantize's (QuantizedWeight, GptqStats); the
    QuantizedWeight holds W · s (the folded model's weight); its loss equals the loss of Q / s against H.
    """
    return gptq_quantize(W.float() * s.float()[None, :], scale_hessian(H, s), **gptq_kwargs)


def wrong_coordinates_quantize(W: torch.Tensor, H: torch.Tensor, s: torch.Tensor, **gptq_kwargs):
    """The known-bad variant (Hessian collected before scaling, used on the scaled weights). Kept only so the
    regression test and the quality benchmark can show the difference; never used by a recipe."""
    return gptq_quantize(W.float() * s.float()[None, :], H.float(), **gptq_kwargs)
