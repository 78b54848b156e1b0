"""Weight layout conversions of the grouped MLP, each with its inverse.

* GLU interleaving of FC1: rows ``[a | b]`` (activated half first) <-> blocks of ``k`` rows
  ``[a0:k, b0:k, ak:2k, ...]`` (weights ``[G, 2F, H]`` along the rows, biases ``[G, 2F]``).
* Grouped vs indexed expert weights in a state dict: one ``<prefix>weight [G, out, in]`` (and
  ``<prefix>bias [G, out]``) <-> ``<prefix>weight0 .. weight{G-1}`` (and ``bias0 ..``), the two
  forms Megatron-LM's grouped linear layers save and load.

A conversion never mutates its input: it returns a new state dict and a one-line status. When it
cannot convert cleanly (nothing to convert, the target keys already present, an incomplete set of
indexed keys, a group count that does not match) it returns the input unchanged and says why.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mhctool.references.moe import deinterleave, interleave_glu


def interleave_fc1(weight: torch.Tensor, k: int) -> torch.Tensor:
    """``[..., 2F, H]`` weights (rows ``[a | b]``) -> rows interleaved in blocks of ``k``."""
    return interleave_glu(weight, k, dim=-2)


def deinterleave_fc1(weight: torch.Tensor, k: int) -> torch.Tensor:
    return deinterleave(weight, k, dim=-2)


def interleave_fc1_bias(bias: torch.Tensor, k: int) -> torch.Tensor:
    return interleave_glu(bias, k, dim=-1)


def deinterleave_fc1_bias(bias: torch.Tensor, k: int) -> torch.Tensor:
    return deinterleave(bias, k, dim=-1)


@dataclass(frozen=True)
class Converted:
    state_dict: dict
    changed: bool
    status: str


def _names(prefix: str, what: str, groups: int) -> list[str]:
    return [f"{prefix}{what}{i}" for i in range(groups)]


def to_indexed(state_dict: dict, prefix: str, groups: int) -> Converted:
    """``<prefix>weight [G, out, in]`` (and ``bias``) -> ``<prefix>weight0 ..`` (and ``bias0 ..``)."""
    plan = {}
    for what in ("weight", "bias"):
        key = f"{prefix}{what}"
        if key not in state_dict:
            continue
        targets = _names(prefix, what, groups)
        present = [t for t in targets if t in state_dict]
        if present:
            return Converted(state_dict, False, f"unchanged: {present[0]} is already present beside {key}")
        t = state_dict[key]
        if t.dim() < 2 or t.shape[0] != groups:
            return Converted(state_dict, False, f"unchanged: {key} has shape {tuple(t.shape)}, not [{groups}, ...]")
        plan[key] = dict(zip(targets, t.unbind(0)))
    if not plan:
        return Converted(state_dict, False, f"unchanged: no {prefix}weight to split")
    out = {}
    for key, value in state_dict.items():  # keep the order: the split keys take the grouped key's place
        if key in plan:
            out.update({k: v.clone() for k, v in plan[key].items()})
        else:
            out[key] = value
    return Converted(out, True, f"split {', '.join(plan)} into {groups} indexed tensors each")


def to_grouped(state_dict: dict, prefix: str, groups: int) -> Converted:
    """``<prefix>weight0 .. weight{G-1}`` (and ``bias0 ..``) -> ``<prefix>weight [G, out, in]`` (and ``bias``).
    An incomplete set (some indices missing) or an already present grouped key leaves it unchanged."""
    plan = {}
    for what in ("weight", "bias"):
        names = _names(prefix, what, groups)
        present = [n for n in names if n in state_dict]
        if not present:
            continue
        key = f"{prefix}{what}"
        if key in state_dict:
            return Converted(state_dict, False, f"unchanged: {key} is already present beside {present[0]}")
        if len(present) != groups:
            missing = next(n for n in names if n not in state_dict)
            return Converted(state_dict, False, f"unchanged: incomplete set, {missing} is missing "
                                                f"({len(present)} of {groups} {what} tensors)")
        extra = f"{prefix}{what}{groups}"
        if extra in state_dict:
            return Converted(state_dict, False, f"unchanged: {extra} exists, so there are more than {groups} groups")
        shapes = {tuple(state_dict[n].shape) for n in names}
        if len(shapes) != 1:
            return Converted(state_dict, False, f"unchanged: the {what} tensors differ in shape: {sorted(shapes)}")
        plan[key] = names
    if not plan:
        return Converted(state_dict, False, f"unchanged: no {prefix}weight0 to merge")
    first = {names[0]: key for key, names in plan.items()}
    dropped = {n for names in plan.values() for n in names}
    out = {}
    for key, value in state_dict.items():
        if key in first:
            out[first[key]] = torch.stack([state_dict[n] for n in plan[first[key]]])
        elif key not in dropped:
            out[key] = value
    return Converted(out, True, f"merged {groups} indexed tensors each into {', '.join(plan)}")
