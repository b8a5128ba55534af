"""Triton is imported only when a Triton kernel may run (spd_kernels.dispatch.defer): a CPU
process running the reference ops never imports it; forcing a Triton kernel imports it, and it runs
(here in the interpreter)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_CHILD = """
import json, os, sys, torch
import spd_kernels
from spd_kernels import dispatch, fused_linear, truncate_kv_, verify_greedy
seen = {"import": "triton" in sys.modules}
torch.manual_seed(0)
x, w = torch.randn(3, 16), torch.randn(8, 16)
lengths = torch.full((2,), 5, dtype=torch.int64)
ref = fused_linear(x, w)
truncate_kv_(lengths, torch.tensor(2))
verify_greedy(torch.randn(2, 16), torch.ones(16), 1e-6, w, torch.zeros(2, dtype=torch.int64))
seen["reference ops"] = "triton" in sys.modules
seen["auto on cpu"] = dispatch.select("fused_linear", torch.device("cpu"))[0]
out = fused_linear(x, w, backend="triton")
seen["forced"] = "triton" in sys.modules
seen["close"] = bool(torch.allclose(out, ref, atol=1e-5))
seen["env after"] = os.environ["TRITON_INTERPRET"]  # set back after the kernels' import
print(json.dumps(seen))
"""


def test_triton_is_imported_only_for_a_triton_kernel():
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'python'}:{REPO}", TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen == {"import": False, "reference ops": False, "auto on cpu": "reference",
                    "forced": True, "close": True, "env after": "1"}
