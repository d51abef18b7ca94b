"""The GPU check's quick mode on the CPU: the script a lent GPU runs works end to end, and its
rows hold remat's promises here (bitwise, predicted == measured at the allocator, within the
budget)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.checks import assert_peak_close

EXPERIMENTS = Path(__file__).parents[2] / "experiments"


def test_quick_gpu_check_rows_hold_the_promises(tmp_path: Path) -> None:
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        import gpu_check_remat
    finally:
        sys.path.remove(str(EXPERIMENTS))
    out = tmp_path / "gpu.json"
    rows = gpu_check_remat.main(["--quick", "--models", "gpt", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    methods = {r["method"] for r in rows}
    assert {"eager", "torch_checkpoint every block", "remat keep_all", "native block"} <= methods
    peer = next(r for r in rows if r["method"] == "torch_checkpoint every block")
    for r in rows:
        assert "error" not in r, r
        assert r["equal"], r
        if r["method"].startswith(("remat", "native")):
            assert_peak_close(r["predicted_peak_bytes"], r["allocator_peak_bytes"], r["method"])
            assert r["tensor_peak_bytes"] == r["predicted_tensor_peak_bytes"], r
        if "at every-block peak" in r["method"]:
            assert r["allocator_peak_bytes"] <= peer["allocator_peak_bytes"], r
