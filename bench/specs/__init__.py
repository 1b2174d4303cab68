"""One benchmark spec per op; the interface is documented at the top of ``bench/harness.py``.

Every module here is discovered by :func:`discover`; one that fails to import is reported as
unavailable, never breaking the run.
"""
import importlib
import pkgutil

# Report order; modules not named here follow alphabetically.
ORDER = ("norm", "attention", "matmul", "block")


def names() -> list:
    found = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return [n for n in ORDER if n in found] + [n for n in found if n not in ORDER]


def discover(only=None) -> dict:
    """``{name: module or the import error's description}`` for every spec (or those in ``only``)."""
    from bench.harness import describe_error

    specs = {}
    for name in names():
        if only and name not in only:
            continue
        try:
            specs[name] = importlib.import_module(f"{__name__}.{name}")
        except Exception as exc:  # noqa: BLE001 - a broken spec must not break the run
            specs[name] = describe_error(exc)
    return specs
