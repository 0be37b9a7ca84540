"""Tests of the torch model, its config and the GDN reference kernels."""
