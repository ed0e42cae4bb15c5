"""noisy-temp-server: serve a noisy copy of an LLM at the temperature that brings its sampling
distribution closest to the clean model's.

Importing this package has no side effects: no model loading, no CUDA initialisation, no
network. The heavy pieces (vLLM, transformers) are imported by the modules that need them.
"""

__version__ = "0.4.0"

__all__ = ["__version__"]
