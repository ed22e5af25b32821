"""Where the vertical-slash planner works (megatron_burst.sparse): on the pattern's device, every
tensor it creates naming that device (checked under a meta default device: a tensor made without
an explicit device lands on meta, and mixing it with the real CPU tensors raises); with a constant
number of device-to-host synchronisations per block pair, however many tiles the pair has
(counted on CPU as the syncs the same code would make on CUDA, tests/sync_counter.py); the split
between tiles and gathered rows chosen by the device in one place; the packed plan's forms."""
import pytest
import torch

import megatron_burst as mb
from megatron_burst.masks import vertical_slash as sparse  # the planner's home: patch attributes here
from megatron_burst.masks.dynamic import Dynamic
from megatron_burst.kernels import block_sparse, row_gather, triton_block_sparse as tbs
from megatron_burst.masks.layout import layout_indices_on
from megatron_burst.masks.vertical_slash import VerticalSlash, pattern_blocks, plan_pair
from sync_counter import SyncCounter

CPU = torch.device("cpu")


def _pattern(S: int, h: int = 2, seed: int = 0, band: int = 24, isolated: int = 6, verticals: int = 5):
    """Sinks and random vertical lines, a band of slash offsets (a long run) and isolated ones."""
    g = torch.Generator().manual_seed(seed)
    vertical = torch.cat([torch.arange(2).expand(h, 2), torch.randint(0, S, (h, verticals), generator=g)], 1)
    slash = torch.cat([torch.arange(band).expand(h, band), torch.randint(band, S, (h, isolated), generator=g)], 1)
    return VerticalSlash(vertical, slash)


@pytest.fixture
def meta_default():
    """Run the test body under torch.set_default_device("meta"), restored afterwards."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def _warm_positions(S: int, W: int, layout: str, stripe: int) -> None:
    """Fill layout_indices_on's cache before the meta default device is set: layout.layout_indices
    builds positions on the default device (outside the planner, see the report), so under meta it
    could not copy them to the CPU."""
    for rank in range(W):
        layout_indices_on(S, rank, W, layout, stripe, CPU)


def _attention(q, k, v, dout, pattern, **kw):
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = mb.sparse_cp_attention(ql, kl, vl, pattern, **kw)
    out.backward(dout)
    return [out.detach(), ql.grad, kl.grad, vl.grad]


def test_planner_and_attention_name_their_device(request):
    """Pattern and q on the CPU, the default device meta: every block pair's plan at W = 4 (both
    splits, whole column tiles, rows clipped), the kernels reading those plans, the dynamic
    estimate and sparse_cp_attention at world size 1 (static and dynamic, forward and backward)
    run, and give what they give without the meta default."""
    S, W, local, h, d = 320, 4, 80, 2, 8
    _warm_positions(S, W, "striped", 16)
    _warm_positions(S, 1, "contiguous", 1)
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(S, 1, h, d, generator=g) for _ in range(4))
    expected = [_attention(q, k, v, dout, _pattern(S), layout="contiguous", stripe=1),
                _attention(q, k, v, dout, Dynamic(p_v=0.5, p_s=0.5, last_q=16, pool=4), layout="contiguous",
                           stripe=1)]
    bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
    qb, kb, vb, db = (bhsd(t)[:, :, :local].contiguous() for t in (q, k, v, dout))
    pattern, static = _pattern(S), _pattern(S)  # on the CPU

    request.getfixturevalue("meta_default")
    assert torch.empty(1).device.type == "meta"  # the trap is set
    kinds = set()
    for q_rank in range(W):
        for kv_rank in range(W):
            for q_rows in (None, 40):
                for kind_, mask in (((m.kind, m) for _, m in pattern_blocks(pattern, "striped", q_rank, kv_rank, W,
                                                                           local, 16, q_rows))):
                    kinds.add(kind_)
                    kernel = block_sparse if kind_ == "sparse" else row_gather
                    out, lse = kernel.forward(qb, kb, vb, kind_, 1, 0.3, plan=mask.plan)
                    assert out.device == CPU and lse.device == CPU
                    D = (db * out).sum(-1)
                    grads = kernel.backward(db, qb, kb, vb, D, lse, kind_, 1, 0.3, plan=mask.plan)
                    assert all(t.device == CPU for t in grads)
                    if kind_ == "sparse":
                        tbs.pack(mask.plan, h, CPU)
    assert kinds == {"sparse", "gather"}
    q_pos, kv_pos = (layout_indices_on(S, r, W, "striped", 16, CPU) for r in (3, 1))
    tiles, rows = plan_pair(pattern, S, q_pos, kv_pos, columns="tiles", dense_column=0.0)
    assert tiles and rows == ()
    got = [_attention(q, k, v, dout, static, layout="contiguous", stripe=1),
           _attention(q, k, v, dout, Dynamic(p_v=0.5, p_s=0.5, last_q=16, pool=4), layout="contiguous", stripe=1)]
    for want, have in zip(expected, got):
        for a, b in zip(want, have):
            assert b.device == CPU
            torch.testing.assert_close(b, a, atol=0, rtol=0)


def _count_pair(S: int, W: int, split: str) -> tuple[SyncCounter, int]:
    """Syncs of planning one block pair of a fresh pattern (its tables included) and of both tile
    kernels' forms of the plan; and the pair's number of tiles."""
    local = S // W
    pattern = _pattern(S)
    with SyncCounter() as counter:
        if split == "device default":  # what sparse_cp_attention plans on the CPU: tiles and gathered rows
            blocks = pattern_blocks(pattern, "striped", 2, 1, W, local, 16)
            tiles = next(m.plan for _, m in blocks if m.kind == "sparse")
            assert any(m.kind == "gather" for _, m in blocks)
        else:  # the CUDA split: every visible column in the tiles
            q_pos, kv_pos = (layout_indices_on(S, r, W, "striped", 16, CPU) for r in (2, 1))
            tiles, rows = plan_pair(pattern, S, q_pos, kv_pos, dense_column=0.0)
            assert rows == ()
        tbs.pack(tiles, pattern.vertical.shape[0], CPU)
        block_sparse._batched(tiles, pattern.vertical.shape[0], local, local, CPU)
    return counter, tiles.tiles


@pytest.mark.parametrize("split", ["device default", "all columns in tiles"])
def test_syncs_per_block_pair_do_not_grow_with_tiles(split):
    """Planning a pair of T tiles and one of 4T tiles reads back to the host equally often (a few
    sizes: the pattern's runs once, the plan's sizes, the row groups' sizes), and packing it for
    either kernel reads back nothing."""
    W = 4
    small, t_small = _count_pair(4 * 256, W, split)
    large, t_large = _count_pair(4 * 1024, W, split)
    assert t_large == 4 * t_small >= 16
    assert small.count == large.count <= 3, (small.ops, large.ops)
    assert small.ops == large.ops


def test_the_split_is_chosen_by_the_device(monkeypatch):
    """dense_column_for: CPU gathers the scattered pairs, CUDA puts every visible column in the
    (Triton) tiles; $MEGATRON_BURST_SPARSE_DENSE_COLUMN (read at import) overrides both; plan_pair
    defaults to it for the pattern's device."""
    assert sparse.dense_column_for(CPU) == sparse.CPU_DENSE_COLUMN > 0
    assert sparse.dense_column_for(torch.device("cuda", 0)) == 0.0
    monkeypatch.setattr(sparse, "_DENSE_COLUMN_OVERRIDE", "0.25")
    assert sparse.dense_column_for(CPU) == sparse.dense_column_for(torch.device("cuda")) == 0.25
    monkeypatch.setattr(sparse, "_DENSE_COLUMN_OVERRIDE", None)
    S, W = 512, 2
    q_pos, kv_pos = (mb.layout_indices(S, r, W, "striped", 16) for r in (1, 0))
    assert plan_pair(_pattern(S), S, q_pos, kv_pos)[1]  # the CPU split gathers the isolated slashes
    asked = []
    monkeypatch.setattr(sparse, "dense_column_for", lambda device: asked.append(device) or 0.0)
    assert plan_pair(_pattern(S), S, q_pos, kv_pos)[1] == () and asked == [CPU]


def test_packed_tiles_forms_agree():
    """The planner's PackedTiles written out tile by tile equals the definition; hand-written tiles
    packed by from_tiles come back unchanged; the torch kernel's batched mask equals both; rows
    clipped with first_rows keep the tiles starting before the bound; copies are cached."""
    S, W, h = 480, 3, 2
    pattern = _pattern(S, h)
    q_pos, kv_pos = (mb.layout_indices(S, r, W, "zigzag") for r in (2, 0))
    tiles, _ = plan_pair(pattern, S, q_pos, kv_pos, dense_column=0.0)
    want = pattern.visibility(S, q_pos, kv_pos)
    written = list(tiles)
    assert [t.q1 - t.q0 for t in written][-1] == 160 - 128  # the short last tile
    got = torch.zeros_like(want)
    for t in written:
        got[:, t.q0:t.q1][:, :, t.cols] = t.vis
    assert torch.equal(got, want)
    again = sparse.PackedTiles.from_tiles(written, h, CPU)
    assert again.vis_head.tolist() != tiles.vis_head.tolist()  # another layout of the same bits
    for a, b in zip(again, written):
        assert (a.q0, a.q1) == (b.q0, b.q1) and torch.equal(a.cols, b.cols) and torch.equal(a.vis, b.vis)
    for packed in (tiles, again):
        batched = block_sparse._batched(packed, h, q_pos.numel(), kv_pos.numel(), CPU)
        dense = torch.zeros(h, q_pos.numel() + 1, kv_pos.numel() + 1, dtype=torch.bool)
        for t in range(packed.tiles):
            dense[:, batched.rows[t, :, None], batched.cols[t, None, :]] |= batched.vis[:, t]
        assert torch.equal(dense[:, :-1, :-1], want) and not dense[:, -1].any() and not dense[:, :, -1].any()
    clipped = tiles.first_rows(70)
    assert clipped is tiles.first_rows(70) and clipped.rows == 70
    assert [(t.q0, t.q1) for t in clipped] == [(0, 64), (64, 70)]
    assert torch.equal(next(iter(clipped)).vis, written[0].vis)
    assert tiles.to(CPU) is tiles and pattern.to(CPU) is pattern
    with pytest.raises(ValueError, match="visibility for 2 query heads but q has 4"):
        sparse.as_packed(tiles, 4, CPU)


def test_rows_clipped_blocks_compute_the_first_rows():
    """pattern_blocks(q_rows=r) (selective recompute) gives the rows < r what the whole pair gives
    them, through both parts (tiles and gathered rows), and caches the blocks."""
    S, W, h, d = 512, 2, 2, 8
    local = S // W
    pattern = _pattern(S, h)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, local, d, generator=g, dtype=torch.float64) for _ in range(3))

    def attend(blocks):
        out = torch.zeros(1, h, local, d, dtype=torch.float64)
        lse = torch.full((1, h, local), float("-inf"), dtype=torch.float64)
        for _, m in blocks:
            kernel = block_sparse if m.kind == "sparse" else row_gather
            o, l_ = kernel.forward(q, k, v, m.kind, 1, 0.3, plan=m.plan)
            new = torch.logaddexp(lse, l_)
            ref = torch.where(torch.isinf(new), 0.0, new)
            out = out * torch.exp(lse - ref)[..., None] + o * torch.exp(l_ - ref)[..., None]
            lse = new
        return out, lse

    whole = pattern_blocks(pattern, "striped", 1, 0, W, local, 16)
    assert {m.kind for _, m in whole} == {"sparse", "gather"}
    clipped = pattern_blocks(pattern, "striped", 1, 0, W, local, 16, q_rows=100)
    again = pattern_blocks(pattern, "striped", 1, 0, W, local, 16, q_rows=100)
    assert len(again) == len(clipped) == 2 and all(a.plan is b.plan for (_, a), (_, b) in zip(again, clipped))
    (o1, l1), (o2, l2) = attend(whole), attend(clipped)
    torch.testing.assert_close(o2[:, :, :100], o1[:, :, :100].double(), atol=1e-6, rtol=0)
    torch.testing.assert_close(l2[:, :, :100], l1[:, :, :100].double(), atol=1e-6, rtol=0)
    assert not o2[:, :, 100:].any() and torch.isinf(l2[:, :, 100:]).all()


def test_dynamic_estimate_is_mtrainings_masses_without_per_head_copies():
    """estimate at W = 1 against the masses written out densely (GQA 4/2, batch 2): the last last_q
    queries' causal softmax, summed over batch and rows per key (vertical) and per offset q - k
    (slash); each head's lines are the fewest largest entries reaching p of its mass. And no
    tensor it makes is larger than those queries' scores [b, hq, last_q, n] (fp32): no per-query-head
    copy of k [b, hq, n, d], no int64 offsets per sample and head [b, hq, last_q, n]."""
    from fused_loss_cases import CreatedTensors

    from megatron_burst.masks.dynamic import estimate

    g = torch.Generator().manual_seed(3)
    b, hq, hkv, n, d, last_q = 2, 4, 2, 160, 48, 24
    q, k = torch.randn(b, hq, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    budgets = Dynamic(p_v=0.8, p_s=0.7, last_q=last_q, pool=8)
    with CreatedTensors() as made:
        got = estimate(q, k, budgets, layout="contiguous", stripe=1)
    assert max(numel * torch.empty((), dtype=dt).element_size() for dt, numel in made.made) <= b * hq * last_q * n * 4
    rows = torch.arange(n - last_q, n)
    s = (q[:, :, rows].double() @ k.double().repeat_interleave(hq // hkv, 1).transpose(-1, -2)) * d ** -0.5
    s = s.masked_fill(torch.arange(n)[None, :] > rows[:, None], float("-inf"))
    p = s.softmax(-1).sum(0)  # [hq, last_q, n]
    vertical = p.sum(1)
    offsets = (rows[:, None] - torch.arange(n)[None, :]).clamp_min(0)
    slash = torch.zeros(hq, n, dtype=torch.float64).index_add_(1, offsets.reshape(-1), p.reshape(hq, -1))

    def top_p(mass, share):  # the fewest largest entries reaching share of the row's mass, per head
        out = []
        for row in mass:
            order = row.argsort(descending=True)
            count = int((row[order].cumsum(0) < share * row.sum() * (1 - 1e-9)).sum()) + 1
            out.append(set(order[:count].tolist()))
        return out

    assert [set(v.tolist()) for v in got.vertical] == top_p(vertical, 0.8)
    pooled = slash.view(hq, -1, 8).sum(-1)  # offsets pooled by 8: the count of pools sets the count of offsets
    counts = [len(x) * 8 for x in top_p(pooled, 0.7)]
    want = [set(slash[h].argsort(descending=True)[:counts[h]].tolist()) for h in range(hq)]
    assert [set(x.tolist()) for x in got.slash] == want
