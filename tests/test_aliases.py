"""Modules under their names before the folders moved still import, for one release, and
say where they went: the forms users wrote, in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import importlib, warnings
warnings.simplefilter("error")
import remat  # no old name is used inside remat
from remat._aliases import MOVED, PACKAGES
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    from remat.native.parallel import tensor_parallel
    from remat.graph import profiles
    from remat.rewrite import RematModule
    import remat.native.api as api
    import remat.pipeline
assert tensor_parallel.__module__ == "remat.parallel.tensor", tensor_parallel.__module__
assert profiles is importlib.import_module("remat.measure.profiles")
assert RematModule is remat.RematModule and api.apply is remat.apply
assert remat.native.parallel.tensor_parallel is tensor_parallel  # attribute access
assert remat.api.optimize is remat.optimize
assert remat.pipeline.analyze is remat.analyze
assert all(issubclass(w.category, DeprecationWarning) for w in seen)
said = " ".join(str(w.message) for w in seen)
assert "remat.native.parallel is now remat.parallel.tensor" in said, said
assert not hasattr(importlib.import_module("remat.executors.sac"), "parallel")
for old, new in MOVED.items():
    if old not in PACKAGES:
        assert importlib.import_module(old) is importlib.import_module(new), old
try:
    remat.graph.no_such_module
except AttributeError:
    pass
else:
    raise AssertionError("a stand-in package invents names")
print("ok")
"""


def test_old_module_names_import_the_new_modules_with_a_warning() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
