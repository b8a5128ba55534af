"""The SPD_* environment variables the kernels read, each read and documented here.

spd_kernels imports without the runtime package, so its variables live here; `spd.env` lists
these together with the runtime's, build and script variables (docs/environment.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Var:
    name: str
    default: str
    doc: str
    read_by: str  # the module (or script) that reads it

    def get(self) -> str:
        return os.environ.get(self.name, self.default)


BACKEND = Var("SPD_BACKEND", "", "force a kernel backend: cuda, triton, reference or auto for "
              "every op, or per op (verify_greedy=cuda,anchor_projection=triton); unset: automatic",
              "spd_kernels.dispatch")
PDL = Var("SPD_PDL", "0", "1: launch the GPU kernels as programmatic dependent launches (sm_90+; "
          "read once, at first use)", "spd_kernels._cuda")
ANCHOR_VARIANT = Var("SPD_ANCHOR_VARIANT", "ffma", "the CUDA anchor projection's kernel: ffma "
                     "(timed on the H200) or mma (tensor cores, on request until timed)",
                     "spd_kernels.features")
CHECK_VALUES = Var("SPD_CHECK_VALUES", "0", "1: also check value ranges (token ids, lengths, "
                   "types), which costs a host sync; off, the kernels clamp or mask",
                   "spd_kernels.checks")
SIMT_LIBRARY = Var("SPD_SIMT_LIBRARY", "", "path of a host-emulation build to load in place of "
                   "spd_kernels._spd_simt (the sanitized build of tests/sanitize_emulation.sh)",
                   "spd_kernels._cuda")
SKIP_CUDA_BUILD = Var("SPD_SKIP_CUDA_BUILD", "0", "1: setup.py builds no CUDA extension (and "
                      "the loader says why it is missing)", "setup.py, spd_kernels._cuda")
SKIP_SIMT_BUILD = Var("SPD_SKIP_SIMT_BUILD", "0", "1: setup.py builds no host emulation",
                      "setup.py, spd_kernels._cuda")

# Read by the CUDA C++ itself (getenv, once per process), listed here so it is documented.
VERIFY_VARIANT = Var("SPD_VERIFY_VARIANT", "0", "greedy verify's CUDA load shape: 0 = 2 rows x 4 "
                     "chunks in flight per lane (timed on the H200); 1 and 2 the other shapes",
                     "csrc/kernels/verify.cu (getenv)")

VARIABLES = (BACKEND, PDL, ANCHOR_VARIANT, CHECK_VALUES, SIMT_LIBRARY, SKIP_CUDA_BUILD,
             SKIP_SIMT_BUILD, VERIFY_VARIANT)
