"""Shared library of the EAGLE-3 pipeline: only what two or more stages use."""
