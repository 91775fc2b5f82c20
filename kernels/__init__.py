"""Triton kernels and custom ops of FEPLB (imported as ``feplb.kernels``).

Legend: T tokens, K top-k, M = T*K grouped rows, D hidden, E experts, F ffn, N output features.

Public ops (``torch.library`` operators, namespace ``feplb``, differentiable through autograd Functions; CUDA ->
Triton, CPU -> pure torch):
:func:`routing_metadata`, :func:`permute`, :func:`unpermute`, :func:`grouped_mm`, :func:`glu` (gated activation:
SwiGLU, GeGLU, gpt-oss's) and its shorthand :func:`swiglu`, :func:`mlp_act` (non-gated experts' activation).
Each kernel's launcher (``*_triton``) and pure-torch twin (``*_ref``) live in its module; :func:`triton_on_cpu`
makes the ops run the kernels on CPU tensors under ``TRITON_INTERPRET=1`` (for tests).
"""

if __name__ == "feplb.kernels":
    from ._triton import HAVE_TRITON, INTERPRET, poison_outputs, triton_on_cpu
    from .ops import (
        autocast_dtype,
        autocast_matmul_inputs,
        glu,
        grouped_mm,
        mlp_act,
        permute,
        routing_metadata,
        swiglu,
        unpermute,
    )
    from .routing import RoutingMetadata

    __all__ = [
        "HAVE_TRITON",
        "INTERPRET",
        "RoutingMetadata",
        "autocast_dtype",
        "autocast_matmul_inputs",
        "glu",
        "grouped_mm",
        "mlp_act",
        "permute",
        "poison_outputs",
        "routing_metadata",
        "swiglu",
        "triton_on_cpu",
        "unpermute",
    ]
else:
    # This directory reached as a top-level ``kernels`` (the checkout's root on sys.path, as under ``python -m`` or a
    # notebook started in it): that name belongs to the Hugging Face ``kernels`` package, which transformers imports
    # (and installs). Where that package is installed, it takes this module's place in sys.modules (the import
    # returns it); elsewhere this module defines nothing. Either way the operators are registered once, by
    # feplb.kernels.
    def _hand_over() -> list[str]:
        import importlib.machinery
        import importlib.util
        import os
        import sys

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
        spec = importlib.machinery.PathFinder.find_spec("kernels", path)
        if spec is None or spec.loader is None:
            return []
        real = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = real
        spec.loader.exec_module(real)
        return []

    __all__ = _hand_over()
