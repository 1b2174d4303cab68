"""The tests' own helpers: the fp32 precision context and the fuzz profiles."""
import os
import subprocess
import sys

import pytest
import torch

import fuzzing
from fused_block.kernels import common
from numerics import FP32_PRECISIONS, fp32_matmul_precision

HERE = os.path.dirname(os.path.abspath(__file__))


def test_fp32_matmul_precision_sets_what_the_kernels_read_and_restores_it():
    before = torch.get_float32_matmul_precision()
    with fp32_matmul_precision("high"):
        assert torch.get_float32_matmul_precision() == "high" and common.fp32_precision() == "tf32"
        with fp32_matmul_precision("highest"):
            assert common.fp32_precision() == "ieee"
        assert common.fp32_precision() == "tf32"
    assert torch.get_float32_matmul_precision() == before


def test_fp32_matmul_precision_restores_after_an_error():
    before = torch.get_float32_matmul_precision()
    with pytest.raises(RuntimeError, match="inside"):
        with fp32_matmul_precision("high"):
            raise RuntimeError("inside")
    assert torch.get_float32_matmul_precision() == before


def test_fp32_matmul_precision_rejects_unknown_modes():
    assert FP32_PRECISIONS == ("highest", "high")
    with pytest.raises(ValueError, match="precision"):
        with fp32_matmul_precision("tf32"):
            pass


@pytest.mark.parametrize("profile, counts", [("ci", {16: 16, 12: 12}), ("long", {16: 400}),
                                             ("quick", {16: 4, 12: 3, 40: 10, 2: 3})])
def test_fuzz_profiles_scale_the_example_counts(monkeypatch, profile, counts):
    monkeypatch.setattr(fuzzing, "PROFILE", profile)
    monkeypatch.setattr(fuzzing, "LONG", profile == "long")
    assert {n: fuzzing.examples_for(n) for n in counts} == counts
    s = fuzzing.settings_for(16)
    assert s.deadline is None and s.print_blob and s.derandomize == (profile != "long")


def test_unknown_fuzz_profile_is_refused():
    env = dict(os.environ, FUSED_BLOCK_FUZZ="longer",
               PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", "import fuzzing"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "FUSED_BLOCK_FUZZ must be" in proc.stderr

