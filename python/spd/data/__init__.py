"""Files the project reads: wheels shipped on PyPI, the default-model cache, prompt sets, ShareGPT."""
