"""Hypic compute kernels (torch / Triton only; nothing from the rest of the repo)."""
