"""CUDA-specific helpers built on ``cuda-python``; importable (and inert) without CUDA.

Everything here has a pure-torch fallback in ``dcp_datastates._platform.cuda``; nothing in the library
requires this package to work.
"""

from . import host_memory

__all__ = ["host_memory"]
