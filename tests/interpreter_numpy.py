"""Triton 3.6's interpreter on numpy >= 2.4.

The interpreter keeps every scalar (``tl.program_id``, a size or stride argument, a loop bound)
as a one-element 1-d numpy array, and a tensor used as a Python integer (the bounds of
``tl.range(start, n, step)`` or ``range(lo, hi)`` in a kernel: ``kernels/matmul.py``'s
persistent tile loop, every K loop) goes through ``int(self.handle.data)``. That is numpy's
conversion of an array with ndim > 0 to a scalar: deprecated in numpy 1.25 (a
DeprecationWarning on every loop bound), an error since numpy 2.4 ("TypeError: only
0-dimensional arrays can be converted to Python scalars"; the GPU machine has 2.5). Later Triton reads
``int(self.handle.data.squeeze())``; ``install()`` gives Triton 3.6's interpreter that
reading (the same integer, on every numpy). Nothing else of the interpreter changes.

``strict()`` makes numpy's deprecation warning for that conversion an error, so a run on
numpy < 2.4 (CI pins numpy < 2.3) fails where numpy 2.4 and later would: ``pytest.ini`` does it for the
suite, ``tests/dist_testing.py`` in the ranks it spawns (they run the interpreter on every
machine, also on a GPU machine with numpy 2.5). Checked here: the distributed tests' ranks on
numpy 2.4.6 fail without ``install()`` and pass with it.
"""
import warnings

from triton.runtime import interpreter

# the start of numpy's DeprecationWarning for int()/float() of an array with ndim > 0 (1.25 to 2.3)
SCALAR_CONVERSION = "Conversion of an array with ndim > 0 to a scalar is deprecated"

_original_patch_lang_tensor = interpreter._patch_lang_tensor


def _index(self):
    return int(self.handle.data.squeeze())


def _patch_lang_tensor(tensor, scope):
    _original_patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", _index)


def install() -> None:
    interpreter._patch_lang_tensor = _patch_lang_tensor


def uninstall() -> None:
    interpreter._patch_lang_tensor = _original_patch_lang_tensor


def strict() -> None:
    """From here on (within the current warnings filters), numpy's deprecated array-to-scalar
    conversion raises, as it does on numpy 2.4 and later."""
    warnings.filterwarnings("error", message=SCALAR_CONVERSION, category=DeprecationWarning)
