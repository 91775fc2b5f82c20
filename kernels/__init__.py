"""Triton kernels and custom ops of FEPLB (imported as ``feplb.kernels``)."""
