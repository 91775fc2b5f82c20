"""Test-wide setup, for tests/ and bench/ alike.

Without a GPU, Triton kernels run under the interpreter; the switch must be set before any kernel module is
imported, which is why it lives here and not in a fixture. Under pytest-xdist, tests marked ``timing`` run alone
(``feplb.pytest_plugin``).
"""

import os

import torch

pytest_plugins = ("feplb.pytest_plugin",)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
