"""Build script: the two Python packages live in different folders, plus an optional CUDA extension.

`spd_kernels/` (the ops) sits at the top level so other runtimes can vendor it; the runtime
package `spd` lives in `python/spd`.

The CUDA C++ kernels in `csrc/kernels/` become the extension `spd_kernels._spd_cuda`: nvcc
compiles the .cu files (sm_90 code plus compute_90 PTX, so newer GPUs JIT it;
SPD_CUDA_ARCHS="80;90" changes the list), the host compiler compiles the pybind11 bindings, and
the CUDA runtime is linked statically.
It does not use torch's C++ API (so it builds against a CPU-only torch too). The same sources,
compiled as host C++ against a fiber emulation of CUDA threads (csrc/emulation/simt_host.h), become
`spd_kernels._spd_simt`, which lets the tests run the CUDA kernels on machines without a GPU.
Both are skipped, with a message, when nvcc is not found or SPD_SKIP_CUDA_BUILD=1; the package
works without them (reference and Triton backends).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"
KERNELS = f"{CSRC}/kernels"      # the .cu kernels and their headers (spd_cuda.h, *.cuh)
BINDINGS = f"{CSRC}/bindings"    # the pybind11 modules
EMULATION = f"{CSRC}/emulation"  # the host emulation of CUDA threads, in _spd_simt only
# Every kernel source is compiled, so a new op needs no change here.
CU_SOURCES = sorted(p.name for p in (ROOT / KERNELS).glob("*.cu"))
SIMT_ONLY = ["simt_host.h", "simt_host.cpp"]  # in EMULATION
# SPD_SIMT_SANITIZE=1: the emulation alone, with AddressSanitizer and the alignment check, so an
# out-of-bounds or misaligned access in a kernel stops the process (tests/sanitize_emulation.sh
# loads it with the sanitizer runtimes preloaded). The fibers' stacks are switched by hand, which
# AddressSanitizer's stack checks do not follow: only heap, global and alignment checks.
SANITIZE = os.environ.get("SPD_SIMT_SANITIZE", "0") == "1"
SANITIZER_FLAGS = ["-fsanitize=address,alignment", "-fno-sanitize-recover=all"]


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def _included(source: Path, include_dirs: list[Path]) -> set[Path]:
    """Every file `source` includes with #include "...", directly or through another, found as
    the compiler finds it (the including file's folder, then the -I folders). Conditional
    includes count too (a needless rebuild at worst); <...> headers (toolkit, pybind11) do not."""
    found: set[Path] = set()
    todo = [source.resolve()]
    while todo:
        current = todo.pop()
        for name in _INCLUDE.findall(current.read_text(encoding="utf-8", errors="replace")):
            for folder in (current.parent, *include_dirs):
                path = (folder / name).resolve()
                if path.is_file():
                    if path not in found:
                        found.add(path)
                        todo.append(path)
                    break
    return found


def _newest(paths) -> float:
    return max((p.stat().st_mtime for p in paths), default=0.0)


def _say(msg: str) -> None:
    print(f"spd setup: {msg}", file=sys.stderr)


def _find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def _toolkit_dir(nvcc: str, subdirs: tuple[str, ...], name: str) -> Path:
    """The toolkit folder (one of subdirs) holding `name`; nvcc may be a wrapper script outside
    CUDA_HOME."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             str(Path(nvcc).resolve().parent.parent), "/usr/local/cuda"]
    for home in filter(None, homes):
        for sub in subdirs:
            if (Path(home) / sub / name).exists():
                return Path(home) / sub
    raise RuntimeError(f"{name} not found: set CUDA_HOME to the CUDA toolkit, or "
                       "SPD_SKIP_CUDA_BUILD=1 to install without the CUDA extensions")


def _cudart_dir(nvcc: str) -> Path:
    """The folder holding libcudart_static.a."""
    return _toolkit_dir(nvcc, ("lib64", "lib", "targets/x86_64-linux/lib",
                               "targets/sbsa-linux/lib"), "libcudart_static.a")


def _cuda_include(nvcc: str) -> Path:
    """The toolkit's include folder (cuda_bf16.h and friends, for the host emulation)."""
    return _toolkit_dir(nvcc, ("include", "targets/x86_64-linux/include",
                               "targets/sbsa-linux/include"), "cuda_bf16.h")


def _gencode_flags() -> list[str]:
    archs = [a.strip() for a in os.environ.get("SPD_CUDA_ARCHS", "90").replace(",", ";").split(";")
             if a.strip()]
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")  # portable PTX
    return flags


class BuildExt(build_ext):
    """Compiles the kernel sources into objects (in parallel, skipped when up to date), then links
    them into the pybind11 extension with the default toolchain:
      _spd_cuda: csrc/kernels/*.cu with nvcc, the CUDA runtime linked statically;
      _spd_simt: the same .cu files as host C++ (SPD_SIMT_HOST, csrc/emulation/) plus the fiber
                 scheduler, so tests run the kernels on a CPU; no CUDA runtime."""

    def build_extension(self, ext):
        if ext.name not in ("spd_kernels._spd_cuda", "spd_kernels._spd_simt"):
            return super().build_extension(ext)
        nvcc = _find_nvcc()
        simt = ext.name == "spd_kernels._spd_simt"
        tmp = Path(self.build_temp) / (("simt-sanitized" if SANITIZE else "simt") if simt
                                       else "cuda")
        tmp.mkdir(parents=True, exist_ok=True)
        # The folders the compiler searches (-I): an object is stale when its source or any
        # header it includes is newer (nvcc never sees the emulation's folder).
        include_dirs = [ROOT / KERNELS] + ([ROOT / EMULATION] if simt else [])
        if simt:
            cxx = os.environ.get("CXX") or shutil.which("c++") or "g++"
            base = [cxx, "-O2", "-std=c++17", "-fPIC", "-DSPD_SIMT_HOST", f"-I{ROOT / KERNELS}",
                    f"-I{ROOT / EMULATION}",
                    # CUDA code reads 16-byte loads as bf16 pairs; g++ -O2 would assume no alias
                    "-fno-strict-aliasing",
                    f"-I{_cuda_include(nvcc)}", "-Wno-unknown-pragmas"]
            if SANITIZE:
                base += [*SANITIZER_FLAGS, "--param", "asan-stack=0", "-fno-omit-frame-pointer",
                         "-g"]
                ext.extra_link_args = [*ext.extra_link_args, *SANITIZER_FLAGS]
            sources = [f"{KERNELS}/{n}" for n in CU_SOURCES] + [
                f"{EMULATION}/{n}" for n in SIMT_ONLY if n.endswith(".cpp")]
        else:
            base = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", f"-I{ROOT / KERNELS}",
                    *_gencode_flags()]
            sources = [f"{KERNELS}/{n}" for n in CU_SOURCES]

        def compile_one(rel: str) -> str:
            src = ROOT / rel
            name = src.name
            obj = tmp / (name + ".o")
            if obj.exists() and obj.stat().st_mtime >= _newest([src, *_included(src, include_dirs)]):
                return str(obj)
            lang = ["-x", "c++"] if simt and name.endswith(".cu") else []
            cmd = [*base, *lang, "-c", str(src), "-o", str(obj)]
            _say(" ".join(cmd) + "\n")
            subprocess.run(cmd, check=True)
            return str(obj)

        with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
            ext.extra_objects = list(pool.map(compile_one, sources))
        ext.depends = [*ext.depends, *ext.extra_objects]  # a rebuilt object relinks the module
        if not simt:
            ext.library_dirs = [str(_cudart_dir(nvcc))]
            ext.libraries = ["cudart_static", "dl", "rt", "pthread"]
        return super().build_extension(ext)


def _extensions() -> list[Extension]:
    if os.environ.get("SPD_SKIP_CUDA_BUILD", "0") == "1":
        _say("SPD_SKIP_CUDA_BUILD=1: not building the CUDA extension spd_kernels._spd_cuda")
        return []
    if _find_nvcc() is None:
        _say("nvcc not found (set CUDA_HOME or put nvcc on PATH): not building the CUDA "
             "extension spd_kernels._spd_cuda; the reference and Triton backends still work")
        return []
    try:
        import pybind11
    except ImportError:
        _say("pybind11 is not installed: not building the CUDA extension spd_kernels._spd_cuda")
        return []
    flags = ["-O2", "-std=c++17", "-fvisibility=hidden"]
    # bindings/ for its own headers, kernels/ for spd_cuda.h
    includes = [pybind11.get_include(), BINDINGS, KERNELS]

    def depends(source: str) -> list[str]:
        """What the bindings' compile reads besides its source: every project file it includes
        (checks.h, spd_cuda.h, bindings.cpp for _spd_simt), so a change to any of them rebuilds
        the module. The kernels come in as objects, each rebuilt from its own includes
        (BuildExt), and a rebuilt object relinks the module."""
        found = _included(ROOT / source, [ROOT / BINDINGS, ROOT / KERNELS])
        return sorted(str(p) for p in found)

    cuda_src, simt_src = f"{BINDINGS}/bindings.cpp", f"{BINDINGS}/bindings_simt.cpp"
    cuda = Extension("spd_kernels._spd_cuda", sources=[cuda_src], include_dirs=includes,
                     language="c++", extra_compile_args=flags, depends=depends(cuda_src))
    # The same kernels on the host, for tests on machines without a GPU (csrc/emulation).
    simt = Extension("spd_kernels._spd_simt", sources=[simt_src], include_dirs=includes,
                     language="c++", extra_compile_args=flags, depends=depends(simt_src))
    if SANITIZE:
        _say("SPD_SIMT_SANITIZE=1: building the host emulation alone, with sanitizers")
        return [simt]
    if os.environ.get("SPD_SKIP_SIMT_BUILD", "0") == "1":  # e.g. on a GPU machine, to save time
        _say("SPD_SKIP_SIMT_BUILD=1: not building the host emulation spd_kernels._spd_simt")
        return [cuda]
    return [cuda, simt]


setup(
    packages=(find_packages("python", include=["spd", "spd.*"])
              + find_packages(".", include=["spd_kernels", "spd_kernels.*"])),
    package_dir={"spd": "python/spd", "spd_kernels": "spd_kernels"},
    # Trained PDMs shipped for the default model (int8, a few MB each); py.typed: PEP 561.
    package_data={"spd": ["checkpoints/*/*.json", "checkpoints/*/*.safetensors", "py.typed",
                          "data/*.jsonl"],
                  "spd_kernels": ["py.typed"]},
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExt},
)
