"""bench/gpu_check.py is the one prepared script a lent GPU runs (issue 21, item 7): its flow is
checked here on CPU tensors (--device cpu), so that a session with a GPU does not spend its few
minutes on a broken script."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_check_runs_every_measurement_on_cpu_and_checks_the_bytes(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_check.py"),
                        "--device", "cpu", "--configs", "0.004:20,0.002:200", "--reps", "1",
                        "--warm", "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    rows = [ln for ln in lines if ln.startswith("| cpu (dry run) |")]
    assert len(rows) == 2, r.stdout
    out = json.loads(lines[-1])
    assert [x["tensors"] for x in out["results"]] == [20, 200]
    for x in out["results"]:
        assert x["bit_exact"] is True
        assert x["storage_read"] == "warm"
        for key in ("save_vs_d2h", "first_save_vs_d2h", "restore_memory_vs_h2d",
                    "first_restore_vs_h2d", "restore_storage_vs_h2d"):
            assert x[key] > 0
