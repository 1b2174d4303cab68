"""The specs' quick cases under pytest-benchmark (``pytest bench --benchmark-only``).

The timed function ends with ``torch.cuda.synchronize()``, so each round measures the kernels'
completion, not their launch. Rates from the median go to ``extra_info``.
"""
import pytest
import torch

from bench import harness

ROUNDS = 20


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="benchmarks time CUDA kernels and need an NVIDIA GPU (torch.cuda.is_available() is False)")
def test_benchmark(benchmark, case_provider):
    case, provider = case_provider
    try:
        fn = case.providers[provider]()
        fn()  # compile, autotune
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - e.g. an SDPA backend or an optional package missing
        pytest.skip(f"{provider} unavailable: {harness.describe_error(exc)}")

    def timed():
        fn()
        torch.cuda.synchronize()

    benchmark.pedantic(timed, rounds=ROUNDS, warmup_rounds=3, iterations=1)
    if not benchmark.stats:  # --benchmark-disable: the function ran once, untimed
        return
    ms = benchmark.stats["median"] * 1e3
    if case.bytes is not None:
        benchmark.extra_info["GB/s"] = round(case.bytes / ms * 1e-6, 1)
    if case.flops is not None:
        benchmark.extra_info["TFLOP/s"] = round(case.flops / ms * 1e-9, 2)
