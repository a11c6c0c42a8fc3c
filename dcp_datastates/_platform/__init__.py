"""What the machine offers: pinned host memory via CUDA (``cuda``), page population (``pages``).

Owns: the one guarded import of ``cuda_ext`` and its pure-torch fallback.
May import: nothing of the package.
"""
