"""Rank-side bodies of the comm tests (byte counting from other threads)."""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

import megatron_burst as mb
from attention_cases import full_inputs


def _attention_call(algo: str):
    W, r = dist.get_world_size(), dist.get_rank()
    q, k, v, dout = full_inputs(8 * W, 1, 4, 2, 8, torch.float32, seed=0)
    sh = lambda t: mb.shard(t, 0, r, W, "zigzag").clone()  # noqa: E731
    leaves = [sh(t).requires_grad_() for t in (q, k, v)]
    return leaves, sh(dout), algo


def _in_thread(fn):
    errors = []

    def run():
        try:
            fn()
        except BaseException as exc:  # surface it in the caller
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def bytes_by_thread(algo: str):
    """Bytes counted by a counter opened in the caller's thread when the backward (then the whole
    forward + backward) runs in the caller's thread or in another one."""
    counts = {}
    leaves, dout, algo = _attention_call(algo)
    with mb.comm_counter() as c:
        mb.cp_attention(*leaves, algo=algo).backward(dout)
    counts["caller"] = (c.bytes("sent", phase="forward"), c.bytes("sent", phase="backward"))
    with mb.comm_counter() as c:
        out = mb.cp_attention(*leaves, algo=algo)
        _in_thread(lambda: out.backward(dout))
    counts["backward_in_thread"] = (c.bytes("sent", phase="forward"), c.bytes("sent", phase="backward"))
    with mb.comm_counter() as c:
        _in_thread(lambda: mb.cp_attention(*leaves, algo=algo).backward(dout))
    counts["all_in_thread"] = (c.bytes("sent", phase="forward"), c.bytes("sent", phase="backward"))
    return counts
