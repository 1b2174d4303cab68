"""Shared hypothesis set-up for the fuzz tests: profiles, dtypes and memory layouts.

The CI profile is bounded (each fuzz test sets its own example count so the suite stays in
its time budget); ``FUSED_BLOCK_FUZZ=long`` multiplies the counts by 25 for a long run.
Failing examples found in either profile are kept as ``@example`` regression cases.
"""
import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

LONG = os.environ.get("FUSED_BLOCK_FUZZ") == "long"
DTYPE = st.sampled_from((torch.float32, torch.float16, torch.bfloat16))
LAYOUTS = st.sampled_from(("contiguous", "row_padded", "strided", "transposed"))


def settings_for(examples):
    return settings(max_examples=examples * (25 if LONG else 1), deadline=None, derandomize=not LONG,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


def layout(t, kind):
    """The same values as 2-D ``t`` in another memory layout (a leaf tensor, no grad yet)."""
    rows, n = t.shape
    if kind == "contiguous":
        return t.clone()
    if kind == "row_padded":  # row stride > n, unit last stride: a view of a wider buffer
        buf = torch.zeros(rows, n + 3, dtype=t.dtype, device=t.device)
        buf[:, :n] = t
        return buf[:, :n]
    if kind == "strided":  # last-dim stride 2
        buf = torch.zeros(rows, 2 * n, dtype=t.dtype, device=t.device)
        buf[:, ::2] = t
        return buf[:, ::2]
    if kind == "transposed":
        return t.t().contiguous().t()
    raise ValueError(kind)
