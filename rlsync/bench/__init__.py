"""Benchmarks behind ``rlsync bench``; each measures rlsync against baselines in the same run."""
