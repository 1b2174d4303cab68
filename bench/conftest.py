"""pytest-benchmark set-up: ``pytest bench --benchmark-only`` times every spec's quick cases.

Each (case, provider) is one test, parametrized here from ``bench/specs`` so that the same
specs serve ``python -m bench`` and pytest-benchmark. Without CUDA every test is skipped with
the reason. The main test command (``pytest tests``) never collects this folder.
"""
from bench import harness, specs

# The quick cases, with torch.compile's default mode, as under ``python -m bench --quick``.
harness.QUICK = True


def quick_params():
    """``(ids, [(case, provider), ...])`` for every quick case of every importable spec."""
    ids, params = [], []
    for mod in specs.discover().values():
        if isinstance(mod, str):  # import failed: python -m bench reports it
            continue
        try:
            cases = mod.cases(True)
        except Exception:  # noqa: BLE001 - likewise reported by python -m bench
            continue
        for case in cases:
            for provider in case.providers:
                dtype = str(case.dtype).replace("torch.", "")
                ids.append(f"{case.op}-{case.label}-{dtype}-{case.mode}-{provider}")
                params.append((case, provider))
    return ids, params


def pytest_generate_tests(metafunc):
    if "case_provider" in metafunc.fixturenames:
        ids, params = quick_params()
        metafunc.parametrize("case_provider", params, ids=ids)

