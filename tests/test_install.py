"""The package installs offline, editable and regular, and imports as ``fused_block.kernels``.

A GPU machine has no network (issue 9 §1): ``pip install --no-index --no-deps
--no-build-isolation [-e] .`` must build with the setuptools already installed. Each test
copies the checkout as a clean clone has it (no ``.git``, build outputs, caches or the
developer's ``fused_block/kernels`` symlink), makes a fresh venv that sees this interpreter's
packages (torch, triton, setuptools, pip), really runs pip in it and imports the package from
another directory.

The venv sees this interpreter's site-packages through a ``.pth`` file rather than
``--system-site-packages`` alone: when the tests run in a venv, that option would expose the
base interpreter's packages, not this venv's. A plain path line does not run the ``.pth``
files found there, so an editable install of the checkout in this interpreter's environment
stays invisible. pip runs with ``--isolated`` (no configuration files or ``PIP_*`` variables)
and never uninstalls a distribution outside the venv it installs into.
"""
import json
import os
import shutil
import site
import subprocess
import sys
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a clean clone lacks: version control, the venv, build outputs and caches.
NOT_IN_A_CLONE = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", ".benchmarks"}

CHECK = """
import importlib.metadata, importlib.util, json
import fused_block, fused_block.kernels
from fused_block.kernels import common
print(json.dumps({"fused_block": fused_block.__file__, "kernels": fused_block.kernels.__file__,
                  "common": common.__file__, "launch": callable(common.launch),
                  "top_level_kernels": importlib.util.find_spec("kernels") is not None,
                  "dist_site": str(importlib.metadata.distribution("fused-block").locate_file(""))}))
"""


def _ignore(folder, names):
    return {n for n in names
            if n in NOT_IN_A_CLONE or n.endswith(".egg-info") or os.path.islink(os.path.join(folder, n))}


def _env():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PIP_")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _venv_seeing_this_environment(path):
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(path)
    python = os.path.join(path, "Scripts" if os.name == "nt" else "bin", "python")
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], path).strip()
    ours = [p for p in site.getsitepackages() if os.path.isdir(p)]
    with open(os.path.join(purelib, "_this_environment.pth"), "w", encoding="utf-8") as f:
        f.write("\n".join(ours) + "\n")
    return python, purelib


@pytest.mark.parametrize("editable", [True, False], ids=["editable", "regular"])
def test_offline_install_imports_fused_block_kernels(tmp_path, editable):
    src = tmp_path / "clone"
    shutil.copytree(ROOT, src, ignore=_ignore)
    assert not (src / "fused_block" / "kernels").exists()  # as in a clean clone
    python, purelib = _venv_seeing_this_environment(str(tmp_path / "venv"))

    pip = [python, "-m", "pip", "--isolated", "install", "--no-index", "--no-deps", "--no-build-isolation",
           "--no-cache-dir", "--disable-pip-version-check", "-q"]
    _run(pip + (["-e", "."] if editable else ["."]), str(src))

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    found = json.loads(_run([python, "-c", CHECK], str(elsewhere)).strip().splitlines()[-1])
    found = {k: os.path.realpath(v) if isinstance(v, str) else v for k, v in found.items()}
    src, purelib = os.path.realpath(src), os.path.realpath(purelib)
    if editable:  # the checkout's own files, kernels/ mapped to fused_block.kernels
        assert found["fused_block"] == os.path.join(src, "fused_block", "__init__.py")
        assert found["kernels"] == os.path.join(src, "kernels", "__init__.py")
        assert found["common"] == os.path.join(src, "kernels", "common.py")
    else:  # copies in the venv's site-packages
        assert found["fused_block"] == os.path.join(purelib, "fused_block", "__init__.py")
        assert found["kernels"] == os.path.join(purelib, "fused_block", "kernels", "__init__.py")
        assert found["common"] == os.path.join(purelib, "fused_block", "kernels", "common.py")
    assert found["launch"]
    assert not found["top_level_kernels"], "kernels/ must not be importable as a top-level package"
    assert found["dist_site"] == purelib, "the installed metadata is not the venv's"
