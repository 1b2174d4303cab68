"""Test set-up: without a GPU, kernels run on CPU tensors through the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before Triton is imported, so it happens here, before any
test module imports fused_block. With a GPU the same tests run on CUDA tensors unchanged.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 could be set")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from fused_block.kernels import common  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every buffer a launcher allocates starts as NaN, so unwritten elements fail the test."""
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)


@pytest.fixture
def launches():
    """Launch counts since the start of the test: proves the Triton path ran."""
    before = common.LAUNCHES.copy()

    class _Delta:
        def __getitem__(self, name):
            return common.LAUNCHES[name] - before[name]

    return _Delta()
