"""Build script: the two Python packages live in different folders.

`spd_kernels/` (the ops) sits at the top level so other runtimes can vendor it; the runtime
package `spd` lives in `python/spd`. Native extensions (csrc/) are added here by later work.
"""
from setuptools import setup

setup(
    packages=["spd", "spd_kernels"],
    package_dir={"spd": "python/spd", "spd_kernels": "spd_kernels"},
    # Trained PDMs shipped for the default model (int8, a few MB each).
    package_data={"spd": ["checkpoints/*/*.json", "checkpoints/*/*.safetensors"]},
)
