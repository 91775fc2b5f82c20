"""Test-wide setup.

Without a GPU, Triton kernels run under the interpreter; the switch must be set before any kernel module is
imported, which is why it lives here and not in a fixture.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
