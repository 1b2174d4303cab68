"""What the GPU scripts ran on: GPU, driver, torch, triton, CUDA, the test plugins, and where
``fused_block.kernels`` was imported from (the offline install's check). Exits 1 without a
CUDA device, so a GPU script run elsewhere cannot pass with every GPU test skipped."""
import importlib.metadata as md
import subprocess
import sys

import torch
import triton


def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"


def driver():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"
    except OSError:
        return "no nvidia-smi"


print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None, "driver", driver())
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print(", ".join(f"{n} {version(n)}" for n in ("pytest", "pytest-xdist", "hypothesis", "pytest-benchmark",
                                               "setuptools", "transformers", "liger-kernel")))
import fused_block.kernels  # noqa: E402 - after the versions, which print even if this fails

print("fused_block.kernels from", fused_block.kernels.__file__)

if not torch.cuda.is_available():
    sys.exit("torch.cuda.is_available() is False: these scripts check the GPU build and need a CUDA device")
