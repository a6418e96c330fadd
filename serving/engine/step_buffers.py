"""A step's ~24 small input arrays travel as one flat buffer per dtype: each host-to-device
transfer costs tens of microseconds of host time, which a one-stream decode step on a CPU
(about 11 ms for SmolLM2) pays in full. `layout` (static, one per bucket shape) says where
each array lies: ((group, name, dtype, shape, offset), ...); the step program unpacks by it.

A step's layout follows from its bucket shape and the names of its arrays, so `pack` keeps
one plan per (shape, names): a step then costs one concatenation per dtype. A step whose
arrays do not fit its plan (a shape or dtype that differs) is laid out from scratch, and
the runner refuses the layout no program was compiled for.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from serving.engine.input_prep import StepArrays


@dataclass(frozen=True)
class _Plan:
    layout: tuple
    groups: tuple  # per dtype, in layout order: (dtype, ((group, name), ...))
    shapes: list  # each array's shape, in the groups' order


_plans: dict[tuple, _Plan] = {}


def pack(arrays: StepArrays) -> tuple[tuple[np.ndarray, ...], tuple]:
    """-> (flat buffers, one per dtype; layout)."""
    key = (arrays.shape, tuple(arrays.batch), tuple(arrays.sampling))
    plan = _plans.get(key)
    if plan is not None:
        buffers = _fill(plan, arrays)
        if buffers is not None:
            return buffers, plan.layout
    buffers, layout = _laid_out(arrays)
    _plans[key] = _plan_of(layout)
    return buffers, layout


def _fill(plan: _Plan, arrays: StepArrays) -> tuple[np.ndarray, ...] | None:
    named = {"batch": arrays.batch, "sampling": arrays.sampling}
    values = [[named[g][k] for g, k in names] for _, names in plan.groups]
    if [np.shape(v) for vs in values for v in vs] != plan.shapes:
        return None
    buffers = tuple(np.concatenate(vs, axis=None) for vs in values)
    if any(b.dtype != dt for b, (dt, _) in zip(buffers, plan.groups)):
        return None
    return buffers


def _laid_out(arrays: StepArrays):
    by_dtype: dict[str, list] = {}
    for group, named in (("batch", arrays.batch), ("sampling", arrays.sampling)):
        for k, v in named.items():
            v = np.asarray(v)
            by_dtype.setdefault(v.dtype.str, []).append((group, k, v))
    buffers, layout = [], []
    for dt in sorted(by_dtype):
        offset = 0
        for g, k, v in by_dtype[dt]:
            layout.append((g, k, dt, v.shape, offset))
            offset += v.size
        buffers.append(np.concatenate([v.reshape(-1) for _, _, v in by_dtype[dt]]))
    return tuple(buffers), tuple(layout)


def _plan_of(layout: tuple) -> _Plan:
    groups: dict[str, list] = {}
    for g, k, dt, _, _ in layout:
        groups.setdefault(dt, []).append((g, k))
    return _Plan(layout, tuple((np.dtype(dt), tuple(names)) for dt, names in groups.items()),
                 [shape for _, _, _, shape, _ in layout])


def unpack(buffers, layout):
    """The step program's side: (batch arrays, sampling arrays) from pack's buffers."""
    by_dtype = {np.dtype(b.dtype).str: b for b in buffers}
    out = {"batch": {}, "sampling": {}}
    for group, name, dt, shape, offset in layout:
        size = int(np.prod(shape, dtype=np.int64))
        out[group][name] = by_dtype[dt][offset:offset + size].reshape(shape)
    return out["batch"], out["sampling"]
