"""Write a plan's graphs to a folder as readable Python, and load them back.

``module.export(folder)`` writes ``forward/``, ``backward/`` and ``inference/`` (each a
package made by ``torch.fx.GraphModule.to_folder``: ``module.py`` holds the generated code, one
line per op in execution order, recomputations inlined in the backward) and ``plan.json``
(the plan file: what is saved and recomputed, and the graph's fingerprint). Calling conventions:
``forward(*primals) -> (*user_outputs, *buffer_updates, *saved)``,
``backward([*saved, *external_reads, *tangents]) -> grads`` (boxed: it empties its list as it
goes, so saved values are freed after their last use), ``inference(*primals)``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from torch import fx

from remat.executors.graph.partition import SplitGraphs

PARTS = ("forward", "backward", "inference")


def export_graphs(graphs: SplitGraphs, folder: str | Path) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for part in PARTS:
        gm: fx.GraphModule = getattr(graphs, part)
        gm.to_folder(folder / part, module_name=part.capitalize())
        # to_folder loads its tensor constants from an absolute path: make the folder movable.
        code = folder / part / "module.py"
        text = code.read_text().replace(
            f"torch.load(r'{folder / part / 'state_dict.pt'}')",
            "torch.load(__import__('os').path.join(__import__('os').path.dirname(__file__), "
            "'state_dict.pt'))",
        )
        code.write_text(text)
    return folder


def load_graphs(folder: str | Path) -> SplitGraphs:
    """The graphs :func:`export_graphs` wrote, as modules (code as on disk)."""
    folder = Path(folder)
    loaded = {}
    for part in PARTS:
        path = folder / part / "module.py"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: not a folder written by module.export")
        name = f"_remat_export_{abs(hash(str(folder)))}_{part}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        loaded[part] = getattr(mod, part.capitalize())()
    return SplitGraphs(**loaded)  # type: ignore[arg-type]
