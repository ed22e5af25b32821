from setuptools import find_packages, setup

setup(
    name="megatron-burst",
    version="0.1.0",
    description="Context-parallel BurstAttention, ring and memory optimizations for Megatron-Core",
    packages=find_packages(include=["megatron_burst", "megatron_burst.*"]),
    python_requires=">=3.10",
    # torch is not pinned here: a looser spec would pull CUDA wheels on CPU machines; the Makefile
    # installs torch==2.13.0 when it is absent.
    install_requires=["torch>=2.6", "megatron-core>=0.15,<0.17", "numpy", "pyyaml"],  # pyyaml: functional-test cases
    extras_require={
        # triton: its CPU interpreter tests the GPU kernels; six, regex, pydantic: what Megatron-LM's
        # training package imports when the functional-test check drives its parse_args; pytest-xdist:
        # make test runs in 2 workers (the suite is CPU-bound: 2 workers fill the 2 cores CI has)
        "test": ["pytest>=7", "pytest-xdist", "triton", "six", "regex", "pydantic"],
        "bench": ["matplotlib"],
        "triton": ["triton"],
        "gpu": ["flash-attn", "transformer-engine"],
    },
)
