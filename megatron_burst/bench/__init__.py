"""Benchmarks (not tests): ``python -m megatron_burst.bench {attention,kernels} --help``."""
