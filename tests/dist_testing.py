"""Multi-process runs for the distributed tests (tests/test_distributed.py).

Every rank is a CPU process on the gloo backend, with the kernels in the Triton interpreter,
also on a GPU machine (one GPU cannot host several NCCL ranks): the children get
``TRITON_INTERPRET=1`` and no visible GPU in their environment before they import anything.
Ranks meet through a file in a temporary directory (no port to choose), collectives time out
after ``COLLECTIVE_TIMEOUT`` seconds instead of waiting forever, a rank that dies takes the
others down with it (``torch.multiprocessing``), and the whole run has a deadline after which
every rank is killed and the test fails. The single-process run the ranks are compared with
runs in a process of its own beside them (the same environment, and the second core of a
2-core machine is not left idle while the ranks wait on each other).
"""
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = 120


def spawn(fn, world_size, *args, reference=None, timeout=600):
    """``fn(rank, world_size, *args)`` on ``world_size`` fresh processes in one gloo group;
    returns each rank's return value (saved with ``torch.save``), in rank order, and with
    ``reference=(ref_fn, ref_args)`` also ``ref_fn(*ref_args)``, run in one more process
    outside the group: ``(ranks, reference)``."""
    env = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    before = {k: os.environ.get(k) for k in env}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(env)  # the children inherit it at spawn
        try:
            ctx = mp.start_processes(_entry, args=(fn, world_size, tmp, args, reference),
                                     nprocs=world_size + (reference is not None), join=False, start_method="spawn")
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=5):  # raises, naming the rank and its traceback, when one fails
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} processes did not finish within {timeout} s")
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
        if reference is None:
            return ranks
        return ranks, torch.load(os.path.join(tmp, "reference.pt"), weights_only=False)


def _entry(rank, fn, world_size, tmp, args, reference):
    import interpreter_numpy
    import interpreter_speed

    interpreter_numpy.install()  # the interpreter's loop bounds on numpy >= 2.4 (the GPU machine's 2.5)
    interpreter_numpy.strict()  # and fail on an older numpy where numpy >= 2.4 would fail
    interpreter_speed.install()  # the pure overheads the conftest removes in the test processes
    if rank == world_size:  # the single-process run
        torch.save(reference[0](*reference[1]), os.path.join(tmp, "reference.pt"))
        os._exit(0)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done: leave without interpreter teardown. On a loaded 2-core machine a worker once
    # aborted at shutdown after its checks ("terminate called without an active exception", a
    # C++ thread still joinable during static destruction; tests/test_models.py's DDP test).
    os._exit(0)
