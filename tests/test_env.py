"""Every SPD_* variable is documented in spd.env, and read only through the env modules."""
import re
from pathlib import Path

from spd import env

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bSPD_[A-Z][A-Z0-9_]*\b")
# where a variable may be read with os.environ / os.getenv: the two env modules, and setup.py
# (it runs before anything is installed)
READERS = {"python/spd/env.py", "spd_kernels/env.py", "setup.py"}


def _sources():
    for pattern in ("python/spd/**/*.py", "spd_kernels/**/*.py", "benchmarks/*.py",
                    "benchmarks/*.sh", "setup.py", ".ci/run", "tests/sanitize_emulation.sh"):
        yield from ROOT.glob(pattern)


def test_every_variable_is_documented():
    documented = {v.name for v in env.VARIABLES}
    used = {}
    for f in _sources():
        for name in NAME.findall(f.read_text()):
            used.setdefault(name, str(f.relative_to(ROOT)))
    # SPD_SIMT_HOST is a C++ macro, not an environment variable
    missing = {k: v for k, v in used.items() if k not in documented and k != "SPD_SIMT_HOST"}
    assert not missing, f"document these in spd/env.py (or spd_kernels/env.py): {missing}"


def test_python_reads_them_only_through_the_env_modules():
    direct = re.compile(r"(os\.environ(\.get)?\s*[\[(]\s*|os\.getenv\(\s*)[\"']SPD_")
    offenders = [str(f.relative_to(ROOT)) for f in _sources() if f.suffix == ".py"
                 and str(f.relative_to(ROOT)) not in READERS and direct.search(f.read_text())]
    assert not offenders, f"read SPD_* through spd.env / spd_kernels.env: {offenders}"


def test_docs_table_matches():
    doc = (ROOT / "docs" / "environment.md").read_text()
    assert env.table() in doc, "docs/environment.md is out of date: paste spd.env.table()"
