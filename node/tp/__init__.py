"""Tensor-parallel primitives. Every function takes its process group explicitly."""
