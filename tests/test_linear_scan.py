"""The exchange's scans over segments (megatron_burst.linear.exchange): the prefix scan S_in(i + 1) =
keep_i * a_i(S_in(i)) + M_i and its reverse run as wavefronts cut at document resets. Both equal the
one-segment-at-a-time recurrence (and its autograd gradients) for every transition form -- none,
scalar and per-channel decay, the delta rule's matrix -- with per-sample resets, and a packed THD
batch's ~1000 runs take 2W - 1 steps, not ~1000."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_burst.linear import exchange
from megatron_burst.linear.exchange import _prefix_states, _reverse_scan, _waves, local_entering_states, resets

B, H, DK, DV = 2, 2, 3, 4


def _sequential(M, a, matrix, keep):
    """The recurrence one segment at a time (the obviously correct form)."""
    S = [torch.zeros_like(M[0])]
    for i in range(1, M.shape[0]):
        prev = S[-1]
        if a is not None:
            prev = a[i - 1] @ prev if matrix else a[i - 1].unsqueeze(-1) * prev
        if keep is not None:
            prev = keep[i - 1].to(M.dtype).view(-1, 1, 1, 1) * prev
        S.append(prev + M[i - 1])
    return torch.stack(S)


def _inputs(T, form, seed):
    gen = torch.Generator().manual_seed(seed)
    M = torch.randn(T, B, H, DK, DV, generator=gen, dtype=torch.float64)
    a = {"none": None,
         "scalar": torch.rand(T, B, H, 1, generator=gen, dtype=torch.float64),
         "channel": torch.rand(T, B, H, DK, generator=gen, dtype=torch.float64),
         "matrix": 0.5 * torch.randn(T, B, H, DK, DK, generator=gen, dtype=torch.float64)}[form]
    return M, a


def _keep(T, pattern, seed):
    """[T, b] flags: None (no documents), 'per_sample' (random, the samples differ), 'chains' (many
    chains of uneven lengths: whole rows reset often, so waves gather from scattered rows), 'all' (no
    reset)."""
    if pattern is None:
        return None
    if pattern == "all":
        return torch.ones(T, B, dtype=torch.bool)
    gen = torch.Generator().manual_seed(seed + 7)
    keep = torch.rand(T, B, generator=gen) > 0.35
    if pattern == "chains":
        keep &= (torch.rand(T, 1, generator=gen) > 0.4)
    return keep


FORMS = ["none", "scalar", "channel", "matrix"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("T", [1, 2, 7, 13])
@pytest.mark.parametrize("pattern", [None, "per_sample", "chains", "all"])
def test_wavefront_scans_equal_the_sequential_recurrence_and_its_gradients(form, T, pattern):
    M, a = _inputs(T, form, seed=T)
    keep = _keep(T, pattern, seed=T)
    flags = None if keep is None else resets(keep, torch.device("cpu"))
    if pattern == "chains" and T == 13:  # the case that gathers: some wave reads scattered rows of the last
        assert any(src != tuple(range(src[0], src[0] + len(src))) for src in _waves(flags.links, False).source[1:])
        assert any(src != tuple(range(src[0], src[0] + len(src))) for src in _waves(flags.links, True).source[1:])
    matrix = form == "matrix"
    M.requires_grad_(True)
    if a is not None:
        a.requires_grad_(True)
    ref = _sequential(M, a, matrix, keep)
    got = local_entering_states(M, a, matrix, flags)  # autograd through the wavefronts
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)

    delta = torch.randn_like(ref)
    inputs = [M] + ([a] if a is not None else [])
    if T == 1:  # one segment: it enters with zero, nothing flows back
        want = [torch.zeros_like(t) for t in inputs]
    else:
        want = torch.autograd.grad(ref, inputs, delta)
        torch.testing.assert_close(torch.autograd.grad(got, inputs, delta), want, rtol=1e-12, atol=1e-12)

    # the exchange's hand-written backward: dM and da of any subset of segments, from their own S_in only
    mine = tuple(sorted(torch.randperm(T, generator=torch.Generator().manual_seed(T))[: max(1, T // 2)].tolist()))
    S_mine = _prefix_states(M.detach(), None if a is None else a.detach(), matrix, flags, want=mine)
    torch.testing.assert_close(S_mine, ref.detach()[list(mine)], rtol=1e-12, atol=1e-12)
    dM, da = _reverse_scan(delta, S_mine, None if a is None else a.detach(), matrix, flags, mine)
    torch.testing.assert_close(dM, want[0][list(mine)], rtol=1e-12, atol=1e-12)
    if a is not None:
        torch.testing.assert_close(da, want[1][list(mine)], rtol=1e-12, atol=1e-12)


def _thd_links(sequences: int, world_size: int) -> tuple[bool, ...]:
    """The links between a packed THD batch's runs in global order: each sequence is 2W chunks (rank r
    holds r and 2W - 1 - r); rank W - 1's two middle chunks are one run, rank 0's last chunk of a
    sequence and first of the next are one run (a reset: a document starts in it)."""
    links = []
    for s in range(sequences):
        middle = 2 * world_size - 2  # chunks 1 .. 2W - 2 as runs, the middle pair merged: 2W - 3 runs
        first = s == 0
        # run order in one sequence: [chunk 0 (or merged with the previous last chunk)], chunks 1 .. W-2,
        # chunks W-1 and W, chunks W+1 .. 2W-2; then the last chunk, merged with the next sequence's first
        links += ([] if first else [True]) + [True] * (middle - 1) + [True]
        links += [False] if s + 1 < sequences else []  # the run holding the next sequence's start resets
    return tuple(links)


def test_a_thd_batch_of_a_thousand_runs_takes_2w_minus_1_steps():
    W, sequences = 8, 64
    links = _thd_links(sequences, W)
    T = len(links) + 1
    assert T >= 900  # ~ (2W - 1) runs per sequence
    forward, backward = _waves(links, False), _waves(links, True)
    assert len(forward.members) <= 2 * W and len(backward.members) <= 2 * W, (len(forward.members), T)
    assert sorted(i for w in forward.members for i in w) == list(range(T))
    # without documents the chain is every segment: one per step
    assert len(_waves((True,) * (T - 1), False).members) == T


def test_the_waves_use_the_flags_not_only_the_decay():
    """A reset whose flag is dropped from the scan's links would join two chains: the values would
    still be right (keep is 0 there), but a dropped *link* where a sample keeps is wrong -- shown here
    with one sample resetting and the other not."""
    T = 6
    M, a = _inputs(T, "channel", seed=3)
    keep = torch.ones(T, B, dtype=torch.bool)
    keep[2, 0] = False  # sample 0 resets in segment 2, sample 1 does not: the link stays
    flags = resets(keep, torch.device("cpu"))
    assert flags.links[2]
    ref = _sequential(M, a, False, keep)
    torch.testing.assert_close(local_entering_states(M, a, False, flags), ref, rtol=1e-12, atol=1e-12)
    cut = exchange.Resets(flags.keep, flags.links[:2] + (False,) + flags.links[3:])  # a wrongly cut chain
    assert (local_entering_states(M, a, False, cut) - ref)[3:, 1].abs().max() > 1e-3


def test_resets_of_the_wrong_length_are_refused():
    M, a = _inputs(5, "scalar", seed=1)
    with pytest.raises(ValueError, match="document resets for 4 segments, the scan has 5"):
        local_entering_states(M, a, False, resets(torch.ones(4, B, dtype=torch.bool), torch.device("cpu")))


class _CountOps(TorchDispatchMode):
    """Counts the aten ops run: on a GPU each is at least one kernel launch (~5 us)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_the_exchange_scans_of_a_thd_batch_launch_per_wave_not_per_run():
    """A rank's exchange scans every run of the batch (W = 8, 64 sequences: 1023 runs). One op per run
    and step was 23,531 ops forward + backward (> 100 ms of launches per layer on a GPU); per wave it
    is a few hundred, whatever the number of sequences."""
    links = _thd_links(64, 8)
    T = len(links) + 1
    keep = torch.ones(T, 1, dtype=torch.bool)
    keep[:-1, 0] = torch.tensor(links)
    flags = resets(keep, torch.device("cpu"))
    mine = tuple(range(0, T, 8))
    waves = len(_waves(links, False).members)
    for matrix in (False, True):
        M = torch.randn(T, 1, 2, 4, 4)
        a = torch.randn(T, 1, 2, 4, 4) if matrix else torch.rand(T, 1, 2, 4)
        with _CountOps() as count:
            S = _prefix_states(M, a, matrix, flags, want=mine)
            _reverse_scan(torch.randn_like(M), S, a, matrix, flags, mine)
        assert count.ops <= 32 * waves, (matrix, count.ops, waves)


# ------------------------------------------------- the delta rule's per-chunk maps inside a segment
def _chunk_loop(a, b):
    """The maps one chunk at a time (the obviously correct form): through-prefixes and the total."""
    A = torch.eye(a.shape[-1], dtype=a.dtype).expand(a.shape[:-3] + a.shape[-2:])
    Bs = torch.zeros(b.shape[:-3] + b.shape[-2:], dtype=b.dtype)
    As, Bt = [], []
    for i in range(a.shape[-3]):
        A, Bs = a[..., i, :, :] @ A, a[..., i, :, :] @ Bs + b[..., i, :, :]
        As.append(A)
        Bt.append(Bs)
    return torch.stack(As, -3), torch.stack(Bt, -3)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64])
def test_chunk_maps_as_a_tree_equal_the_chunk_by_chunk_product_and_its_gradients(n):
    from megatron_burst.linear.chunked import affine_prefix

    gen = torch.Generator().manual_seed(n)
    a = (torch.eye(DK, dtype=torch.float64) + 0.3 * torch.randn(B, H, n, DK, DK, generator=gen,
                                                                 dtype=torch.float64)).requires_grad_()
    b = torch.randn(B, H, n, DK, DV, generator=gen, dtype=torch.float64, requires_grad=True)
    want_A, want_B = _chunk_loop(a, b)
    got_A, got_B = affine_prefix(a, b, matrix=True)
    torch.testing.assert_close((got_A, got_B), (want_A, want_B), rtol=1e-12, atol=1e-12)
    dA, dB = torch.randn_like(want_A), torch.randn_like(want_B)
    want = torch.autograd.grad((want_A, want_B), (a, b), (dA, dB), retain_graph=True)
    torch.testing.assert_close(torch.autograd.grad((got_A, got_B), (a, b), (dA, dB)), want, rtol=1e-11, atol=1e-11)


def test_a_long_segments_maps_launch_per_tree_level_not_per_chunk():
    """A 128K-token segment has 2048 chunks: one dependent step per chunk was over 8,000 ops forward."""
    from megatron_burst.linear.chunked import affine_prefix

    n = 2048
    a, b = torch.randn(1, 1, n, 2, 2), torch.randn(1, 1, n, 2, 3)
    with _CountOps() as count:
        affine_prefix(a, b, matrix=True)
    assert count.ops <= 48 * 11, count.ops  # log2(2048) = 11 levels


@pytest.mark.parametrize("decay", [False, True])
def test_the_exchange_keeps_only_this_ranks_states_and_the_transitions(decay):
    """What the LASP-2 exchange saves for the backward and returns at W = 8, one segment per rank
    (contiguous): this rank's entering state and the 8 decays, never the all-gather buffer or all 8
    states behind a view (a consecutive pick is a view: 16x the bytes kept)."""
    from megatron_burst.linear.exchange import Lasp2Exchange, SegmentMap

    W = 8
    smap = SegmentMap(None, 0, W, tuple((r,) for r in range(W)), True)
    M = torch.randn(1, 1, H, DK, DV, requires_grad=True)
    a = torch.rand(1, 1, H, DK, requires_grad=True) if decay else None
    gathered = torch.randn(W * (M.numel() + (a.numel() if decay else 0)))
    S = Lasp2Exchange.apply(M, a, gathered, smap, False)
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in S.grad_fn.saved_tensors}
    kept[S.untyped_storage().data_ptr()] = S.untyped_storage().nbytes()
    state, decays = M.numel() * 4, (W * a.numel() * 4 if decay else 0)
    assert sum(kept.values()) == state + decays, (sum(kept.values()), state, decays)
