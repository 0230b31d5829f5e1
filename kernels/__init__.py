"""Triton kernels for pdflow's paged, head-major KV layout; each beside a torch reference.

Installed as ``pdflow.kernels`` (setuptools package-dir) so it never clashes with the
unrelated ``kernels`` distribution on PyPI.
"""
