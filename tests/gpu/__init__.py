"""The GPU test suite (``make gpu-test``). A package, so that the rank bodies in ``gpu.ranks`` unpickle in
the harness's worker processes (they have tests/ on sys.path)."""
