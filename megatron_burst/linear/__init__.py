"""Linear attention under context parallelism (LASP-2; LASP-1 as the baseline).

``megatron_burst.linear.reference`` is the token-by-token recurrence everything is tested against.
"""
