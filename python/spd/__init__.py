"""spd: Speculative Pipeline Decoding (arXiv 2605.30852), lossless by construction.

Public entry points:
    load_target(path_or_None)      -> TargetModel (default: SmolLM2-135M-Instruct, fetched once)
    SPDEngine(target, n_stages=4)  -> .generate(prompt_ids, ...) / .generate_ar(...)
"""
from spd.errors import InternalError, SPDError
from spd.model.loading import load_target
from spd.runtime.engine import SPDEngine
from spd.runtime.types import GenerationResult, SamplingParams
from spd.version import __version__

__all__ = ["GenerationResult", "InternalError", "SPDEngine", "SPDError", "SamplingParams",
           "__version__", "load_target"]
