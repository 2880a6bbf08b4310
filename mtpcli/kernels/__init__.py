"""Compute kernels with an ops reference, per-backend builders, and one public entry each."""
