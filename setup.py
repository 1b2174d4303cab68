from setuptools import setup

setup(
    name="fused-block",
    version="0.1.0",
    description="Triton kernels for the Transformer block: fused add+norm, attention, GEMM epilogues",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # The pure-Triton package lives in kernels/ and installs as fused_block.kernels.
    packages=["fused_block", "fused_block.kernels"],
    package_dir={"fused_block": "fused_block", "fused_block.kernels": "kernels"},
    install_requires=["torch>=2.4", "triton>=3.2", "numpy"],
)
