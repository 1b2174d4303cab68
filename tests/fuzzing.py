"""Shared hypothesis set-up for the fuzz tests: profiles, dtypes and memory layouts.

Profiles (``FUSED_BLOCK_FUZZ``):
- unset, the CI profile: each fuzz test's own example count, derandomized (the same examples
  every run, so a CI failure reproduces), so the suite stays in its time budget;
- ``long``: 25x the examples, random, with hypothesis' example database;
- ``quick``: a quarter of the examples (at least 3), derandomized: ``scripts/gpu_check.sh``,
  where each new shape bucket and flag combination costs a GPU compile.
The explicit ``@example`` regression cases run in every profile. Failures found are kept as
``@example`` cases. No deadline: a GPU's first call of a kernel compiles it (seconds), and
the interpreter is slow on any shape. A failure prints hypothesis' reproduction blob
(``@reproduce_failure``), for runs whose database is not kept (CI, the GPU machine).
"""
import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

PROFILE = os.environ.get("FUSED_BLOCK_FUZZ", "ci")
if PROFILE not in ("ci", "long", "quick"):
    raise ValueError(f"FUSED_BLOCK_FUZZ must be 'long' or 'quick' (or unset), got {PROFILE!r}")
LONG = PROFILE == "long"
DTYPE = st.sampled_from((torch.float32, torch.float16, torch.bfloat16))
LAYOUTS = st.sampled_from(("contiguous", "row_padded", "strided", "transposed"))


def examples_for(examples: int) -> int:
    """The example count of a test that runs ``examples`` in the CI profile."""
    if LONG:
        return 25 * examples
    if PROFILE == "quick":
        return max(3, examples // 4)
    return examples


def settings_for(examples):
    return settings(max_examples=examples_for(examples), deadline=None, derandomize=not LONG, print_blob=True,
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
