"""Test set-up: without a GPU, kernels run on CPU tensors through the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before Triton is imported, so it happens here, before any
test module imports fused_block. With a GPU the same tests run on CUDA tensors unchanged.
Also here: output poisoning and the launch counter (fixtures), the ``gpu_quick`` marker the
GPU check selects, the ``heavy`` marker (left out unless ``FUSED_BLOCK_HEAVY=1`` or ``-m
heavy``) and the ``sweep`` marker (on the CPU, a cross-product's cases beyond its gpu_quick
selection are heavy), ``FUSED_BLOCK_DEADLINE`` (a wall-clock limit for a run), ``FUSED_BLOCK_FIRST`` and
``FUSED_BLOCK_COLLECTED`` (the GPU scripts' run order and list of collected tests), and each
test's seed.
"""
import os
import sys
import time
import zlib

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 could be set")
    os.environ["TRITON_INTERPRET"] = "1"
    # One CPU thread per test process (and its child processes), unless OMP_NUM_THREADS says
    # otherwise: the suite runs a worker per core (pytest-xdist), and torch's default of a
    # thread per core oversubscribes them, where its OpenMP threads wait for each other:
    # a float64 linear of this suite's sizes took 2-3 ms instead of 30-70 us beside another
    # busy process, and test_hf_interface's logits tests ran 2.5x slower.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)

import pytest  # noqa: E402

from fused_block.kernels import common  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_hardware  # noqa: E402
    import interpreter_numpy  # noqa: E402
    import interpreter_speed  # noqa: E402

    interpreter_speed.install()  # one language patch per interpreted launch (see the module)
    interpreter_numpy.install()  # scalar loop bounds read as numpy 2.5 allows (see the module)
    interpreter_hardware.install()  # TF32 products truncate their fp32 operands, as on the GPU

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every buffer a launcher allocates starts as NaN, so unwritten elements fail the test."""
    monkeypatch.setattr(common, "POISON_OUTPUTS", True)


@pytest.fixture(autouse=True)
def gemm_candidate(monkeypatch):
    """Every product on our fused kernel, on CUDA too (the suite tests the kernels, and their
    launch counts do not depend on a timed choice), unless FUSED_BLOCK_GEMM names a candidate;
    tests/test_dispatch.py forces cuBLAS and tests the per-key choice (``dispatch.force``)."""
    from fused_block import dispatch

    monkeypatch.setattr(dispatch, "_FORCE", dispatch._env_force() or dispatch.TRITON)


# Each test draws its random inputs from torch's generator seeded by its own node id (xor this
# base): the draws are random but do not depend on which tests ran before it in its process
# (the order pytest-xdist gives), so a failure reproduces with the test alone. Another
# FUSED_BLOCK_TEST_SEED draws other inputs everywhere.
TEST_SEED = int(os.environ.get("FUSED_BLOCK_TEST_SEED", "0"))


@pytest.fixture(autouse=True)
def seeded_generator(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) ^ TEST_SEED)


@pytest.fixture(autouse=True)
def triton_attention():
    """The attention tests check our kernels: on a GPU the timed choice could hand a case SDPA
    expresses to cuDNN or flash (``fused_block._attn_sdpa``), so our kernels are forced; the
    tests of that choice (tests/test_attention_sdpa.py) set their own."""
    from fused_block import _attn_sdpa

    before = _attn_sdpa.force(_attn_sdpa.TRITON)
    yield
    _attn_sdpa.force(before)


@pytest.fixture(autouse=True)
def triton_norms():
    """Likewise for the norms' timed choice against torch's path (``fused_block.norm``): our
    kernels, but in the tests of that choice (tests/test_norm.py's ``norm_candidate``)."""
    from fused_block import norm

    before = norm.force(norm.TRITON)
    yield
    norm.force(before)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees its own one-time warnings (fused_block's fallbacks warn once per reason)."""
    from fused_block import _backend

    monkeypatch.setattr(_backend, "WARNED", set())


@pytest.fixture(scope="session")
def run_once(tmp_path_factory, worker_id):
    """``run_once(name, make)``: ``make(path)`` writes the file ``name`` once per test run and
    every xdist worker gets its path (the first to ask makes it, the others wait for it): for
    the module fixtures that compile kernels (tests/test_compile.py, tests/test_sass_budgets.py),
    which would otherwise compile once per worker."""
    import filelock

    base = tmp_path_factory.getbasetemp()
    root = base if worker_id == "master" else base.parent  # the run's directory, common to the workers

    def once(name, make):
        path = root / name
        with filelock.FileLock(f"{path}.lock"):
            if not path.exists():
                make(path)
        return path

    return once


@pytest.fixture
def cuda_autocast_norms(monkeypatch):
    """CUDA's autocast policy for the norms on the test's device: CPU autocast runs
    ``layer_norm``/``rms_norm`` in the input's dtype where CUDA's runs them in fp32, so on the
    CPU ``fused_block.norm.autocast_norm_fp32`` says for "cpu" what torch registers for "cuda"
    (on CUDA torch's own answer stands). Compare with torch computing the CUDA way (explicit
    fp32 casts), and on CUDA with torch under ``torch.autocast("cuda")`` itself."""
    from fused_block import norm

    real = norm.autocast_norm_fp32
    monkeypatch.setattr(norm, "autocast_norm_fp32",
                        lambda device_type, is_rms: real("cuda" if device_type == "cpu" else device_type, is_rms))


@pytest.fixture
def fma_chains(monkeypatch):
    """The interpreter computes IEEE fp32 products as the GPU's FMA units do: one FMA per k
    into the accumulator, in k order (``interpreter_hardware.FMA_CHAINS``); nothing on a GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        monkeypatch.setattr(interpreter_hardware, "FMA_CHAINS", True)


@pytest.fixture
def launches():
    """Launch counts since the start of the test: proves the Triton path ran."""
    before = common.LAUNCHES.copy()

    class _Delta:
        def __getitem__(self, name):
            return common.LAUNCHES[name] - before[name]

    return _Delta()


# ---------------------------------------------------------------------------------------------
# gpu_quick: the subset the GPU check runs (``pytest -m gpu_quick``)
# ---------------------------------------------------------------------------------------------

def _value_key(value):
    try:
        hash(value)
        return value
    except TypeError:  # unhashable parameters are the same object in every case that uses them
        return ("id", id(value))


def gpu_quick_selection(items) -> list:
    """Of each test function, the first case, then every case that brings a parameter value
    (a dtype, an activation, a shape, a flag, ...) not yet selected for that function.

    So every test function (op and feature family) runs at least once and meets each of its
    dtypes and feature values at least once; combinations are left to the full suite. It
    depends only on the collected items and their order, so every xdist worker selects the
    same cases, and new tests and parameters are covered without marking anything.
    """
    seen, chosen = {}, []
    for item in items:
        function = item.nodeid.split("[", 1)[0]
        callspec = getattr(item, "callspec", None)
        values = {(name, _value_key(v)) for name, v in callspec.params.items()} if callspec else set()
        if function not in seen or not values <= seen[function]:
            chosen.append(item)
            seen.setdefault(function, set()).update(values)
    return chosen


def breadth_first(items, chosen) -> list:
    """The ``chosen`` items, then the others, each part in rounds: every test function's first
    case, then every function's second, ... (otherwise collection order).

    A run with a deadline (the GPU scripts) takes them in this order, so one cut short has still
    run every test function once rather than the first files in full, and the gpu_quick subset
    (``chosen``) before the cases it leaves out.
    """
    first = {id(item) for item in chosen}
    count, rank = {}, {}
    for item in items:
        function = item.nodeid.split("[", 1)[0], id(item) not in first
        rank[id(item)] = count.get(function, 0)
        count[function] = rank[id(item)] + 1
    return sorted(items, key=lambda item: (id(item) not in first, rank[id(item)]))


def first_listed(items, listed) -> list:
    """``items`` with those whose node id is in ``listed`` first, in ``listed``'s order (ids
    that name no item, renamed or removed tests, are passed over)."""
    where = {nodeid: i for i, nodeid in enumerate(listed)}
    return sorted(items, key=lambda item: where.get(item.nodeid, len(where)))  # stable: the rest as they were


def read_node_ids(path) -> list:
    """Node ids from a file, one a line; blank lines and ``#`` comments ignored."""
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


# ---------------------------------------------------------------------------------------------
# heavy: long cases (torch's full module catalogue, ...) that the default run leaves out
# ---------------------------------------------------------------------------------------------

HEAVY = os.environ.get("FUSED_BLOCK_HEAVY") == "1"


def _runs_heavy(config) -> bool:
    return HEAVY or "heavy" in (config.getoption("markexpr", "") or "")


# sweep: a test function whose cases are a cross-product (dtype x broadcast shape x schedule,
# ...) that the interpreter takes minutes over while the combinations add little: without a
# GPU, the cases outside its gpu_quick selection (each parameter value at least once) are
# heavy ones, so the default run on the CPU keeps that selection; on a GPU every case runs.
def _mark_swept_out(items):
    swept = [item for item in items if item.get_closest_marker("sweep")]
    kept = {id(item) for item in gpu_quick_selection(swept)}
    for item in swept:
        if id(item) not in kept:
            item.add_marker(pytest.mark.heavy)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        _mark_swept_out(items)
    if not _runs_heavy(config):  # deselected, not skipped: they neither pass nor hide a failure
        heavy = [item for item in items if item.get_closest_marker("heavy")]
        if heavy:
            config.hook.pytest_deselected(items=heavy)
            items[:] = [item for item in items if not item.get_closest_marker("heavy")]
    chosen = gpu_quick_selection(items)
    for item in chosen:
        item.add_marker(pytest.mark.gpu_quick)
    if DEADLINE != float("inf"):
        items[:] = breadth_first(items, chosen)
    if FIRST:
        items[:] = first_listed(items, read_node_ids(FIRST))
    if ONLY:
        listed = set(read_node_ids(ONLY))
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in listed])
        items[:] = [item for item in items if item.nodeid in listed]


# ---------------------------------------------------------------------------------------------
# FUSED_BLOCK_FIRST: node ids run first; FUSED_BLOCK_COLLECTED: the run's tests, written out
# ---------------------------------------------------------------------------------------------

# FUSED_BLOCK_FIRST names a file of node ids (one a line, ``#`` comments; scripts/gpu_first.txt)
# that run before every other test, in the file's order (with xdist too: each worker collects
# in this order and the scheduler hands tests out from the front); scripts/junit_summary.py
# names the ids that match no collected test. FUSED_BLOCK_COLLECTED names a file the run
# writes its selected tests' node ids to, one a line in run order (after ``-m``, ``-k`` and
# the heavy marker; with xdist the first worker writes it): scripts/junit_summary.py compares
# it with the JUnit file, so a test that never ran is named, not just missing.
FIRST = os.environ.get("FUSED_BLOCK_FIRST")
COLLECTED = os.environ.get("FUSED_BLOCK_COLLECTED")
# FUSED_BLOCK_ONLY names such a file too: only its tests run (the others are deselected; an id
# that names no test is passed over, where pytest would stop on it as an argument).
ONLY = os.environ.get("FUSED_BLOCK_ONLY")


def pytest_collection_finish(session):
    if COLLECTED and os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":
        with open(COLLECTED, "w") as f:
            f.writelines(item.nodeid + "\n" for item in session.items)


# ---------------------------------------------------------------------------------------------
# FUSED_BLOCK_DEADLINE: a wall-clock limit for a run (the GPU scripts set it)
# ---------------------------------------------------------------------------------------------

# Seconds since the epoch after which no further test starts: each is skipped as not run and
# the session fails. The GPU scripts set it some seconds before their step's `timeout`, so a
# run that would be cut short still finishes, reports what ran and writes its JUnit file.
DEADLINE = float(os.environ.get("FUSED_BLOCK_DEADLINE", "inf"))
NOT_RUN = "not run: FUSED_BLOCK_DEADLINE passed"
_not_run = []


def pytest_runtest_setup(item):
    if time.time() > DEADLINE:
        pytest.skip(NOT_RUN)


def pytest_runtest_logreport(report):
    if report.skipped and NOT_RUN in str(report.longrepr):  # with xdist, the controller counts
        _not_run.append(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    if _not_run:
        terminalreporter.write_line(f"{len(_not_run)} tests {NOT_RUN}: the run is incomplete", red=True)


def pytest_sessionfinish(session):
    if _not_run and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
