"""Batch slicing and rotary embeddings per layout: every rank gets exactly the global positions
the layout assigns it, in the same order, for tokens, labels, masks, position ids and RoPE."""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

SEQ = 24


def _expected_positions(layout: str, rank: int, world: int, seq: int, stripe: int = 1) -> List[int]:
    """Each layout's definition written out independently of megatron_burst.layout."""
    n = seq // world
    if layout == "contiguous":
        return list(range(rank * n, (rank + 1) * n))
    if layout == "zigzag":
        c = n // 2
        late = 2 * world - 1 - rank
        return list(range(rank * c, (rank + 1) * c)) + list(range(late * c, (late + 1) * c))
    return [t for t in range(seq) if (t // stripe) % world == rank]


def slice_batch_on_rank(layout: str, stripe: int = 1, with_mask: bool = False) -> Dict[str, torch.Tensor]:
    """This rank's slice of a batch whose entries encode their global positions."""
    import megatron_burst

    b = 2
    pos = torch.arange(SEQ).expand(b, SEQ)
    batch = {"tokens": pos + 1000, "labels": pos + 2000, "loss_mask": pos.float(),
             "position_ids": pos.clone(), "extra": None}
    if with_mask:
        batch["attention_mask"] = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(b, 1, SEQ, SEQ)
    return megatron_burst.get_batch_on_this_cp_rank(batch, layout=layout, cp_group=dist.group.WORLD,
                                                    stripe=stripe)


def slice_batch_error(batch: Dict[str, torch.Tensor], layout: str) -> str:
    import megatron_burst

    try:
        megatron_burst.get_batch_on_this_cp_rank(batch, layout=layout, cp_group=dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return "ok"


def rope_on_rank(layout: str, seq: int, stripe: int = 1, interleaved: bool = False) -> Dict[str, torch.Tensor]:
    """LayoutRotaryEmbedding's rows on this rank, and Megatron's full-length table."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_burst.megatron.rope import LayoutRotaryEmbedding

    src = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_interleaved=interleaved,
                          rotary_base=10000, use_cpu_initialization=True, cp_group=dist.group.WORLD)
    freqs = src.get_freqs_non_repeated(seq)  # Megatron's own frequency table, [seq, dim/2]
    return {"local": LayoutRotaryEmbedding(src, layout, dist.group.WORLD, stripe)(seq), "freqs": freqs}


def rope_rows_cached() -> bool:
    """The same rows object on a second call; rebuilt (equal) after the module moves."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_burst.megatron.rope import LayoutRotaryEmbedding

    src = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True,
                          cp_group=dist.group.WORLD)
    rope = LayoutRotaryEmbedding(src, "zigzag", dist.group.WORLD)
    first = rope(16)
    same = rope(16) is first
    rope.to("cpu")  # a device move drops the cache
    again = rope(16)
    return same and again is not first and torch.equal(again, first) and rope(8) is not first


@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 3)])
@pytest.mark.parametrize("world", [2, 4])
def test_batch_slicing(layout, stripe, world):
    results = run_ranks(world, slice_batch_on_rank, layout, stripe)
    for rank, out in enumerate(results):
        want = torch.tensor(_expected_positions(layout, rank, world, SEQ, stripe)).expand(2, -1)
        assert torch.equal(out["position_ids"], want), (layout, rank, out["position_ids"][0].tolist())
        assert torch.equal(out["tokens"], want + 1000)
        assert torch.equal(out["labels"], want + 2000)
        assert torch.equal(out["loss_mask"], want.float())
        assert out["extra"] is None
    covered = sorted(sum((r["position_ids"][0].tolist() for r in results), []))
    assert covered == list(range(SEQ))


def test_causal_attention_mask_is_checked_and_dropped():
    for out in run_ranks(2, slice_batch_on_rank, "striped", 1, True):
        assert "attention_mask" in out and out["attention_mask"] is None
        assert out["tokens"].shape == (2, SEQ // 2)


def test_batch_slicing_errors():
    pos = torch.arange(SEQ).expand(2, SEQ)
    not_causal = torch.zeros(2, 1, SEQ, SEQ, dtype=torch.bool)  # "see everything": cannot honour
    cases = [
        ({"tokens": pos, "labels": pos[:, :-1]}, "zigzag", "sequence length 23"),
        ({"tokens": pos[:, :22]}, "zigzag", "not divisible by 4"),
        ({"tokens": pos, "attention_mask": not_causal}, "zigzag", "not the plain causal mask"),
        ({"tokens": torch.arange(SEQ)}, "zigzag", "must be a [b, s, ...] tensor"),
        ({"tokens": pos}, "spiral", "unknown layout 'spiral'"),
    ]
    for batch, layout, needle in cases:
        for msg in run_ranks(2, slice_batch_error, batch, layout):
            assert needle in msg, msg


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("zigzag", 1), ("striped", 1), ("striped", 2)])
def test_rope_rows_follow_layout(layout, stripe, interleaved):
    world, seq = 4, 32
    for rank, res in enumerate(run_ranks(world, rope_on_rank, layout, seq, stripe, interleaved)):
        pos = _expected_positions(layout, rank, world, seq, stripe)
        freqs = res["freqs"][pos]  # [n, dim/2] at this rank's global positions
        if interleaved:
            want = torch.stack((freqs, freqs), dim=-1).reshape(len(pos), -1)
        else:
            want = torch.cat((freqs, freqs), dim=-1)
        assert res["local"].shape == (seq // world, 1, 1, 8)
        assert torch.equal(res["local"][:, 0, 0], want), (layout, rank)


def test_rope_without_cp_is_the_full_table():
    res = run_ranks(1, rope_on_rank, "striped", 16)[0]
    assert torch.equal(res["local"][:, 0, 0], torch.cat((res["freqs"], res["freqs"]), dim=-1))


def test_rope_gives_packed_sequences_the_whole_table():
    """THD batches: Megatron's THD RoPE picks each sequence's rows itself, from the whole table
    (packed_seq=True), as Megatron's RotaryEmbedding returns it on GPU: row p is p x inv_freq
    (it used to be refused)."""
    for ours, megatrons in run_ranks(2, _rope_packed):
        assert ours.shape == (16, 1, 1, 8) and torch.equal(ours, megatrons)


def _rope_packed():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_burst.megatron.rope import LayoutRotaryEmbedding

    src = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True,
                          cp_group=dist.group.WORLD)
    ours = LayoutRotaryEmbedding(src, "zigzag", dist.group.WORLD)(16, packed_seq=True)
    freqs = torch.outer(torch.arange(16, dtype=torch.float32), src.inv_freq.float())  # position x frequency
    return ours, torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def test_rope_keeps_fp32_angles_under_bf16_and_moves_with_the_model():
    """Megatron-LM's Float16Module calls .bfloat16() on the model: RoPE must stay exact."""
    res = run_ranks(2, _rope_after_bfloat16)
    for r in res:
        assert r["dtype"] == torch.float32
        assert torch.equal(r["after"], r["before"])


def _rope_after_bfloat16():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_burst.megatron.rope import LayoutRotaryEmbedding

    src = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True,
                          cp_group=dist.group.WORLD)
    rope = LayoutRotaryEmbedding(src, "striped", dist.group.WORLD)
    before = rope(4096)
    wrapper = torch.nn.Sequential(rope).bfloat16().to("cpu")
    return {"dtype": wrapper[0].inv_freq.dtype, "before": before, "after": wrapper[0](4096)}


def test_mask_check_covers_every_row_chunk(monkeypatch):
    """The causal check walks rows in chunks (no second s x s tensor): a wrong entry in any chunk,
    above or below the diagonal, is found; the plain causal mask passes."""
    from megatron_burst.megatron import batch as batch_mod

    monkeypatch.setattr(batch_mod, "_MASK_ROWS_PER_CHUNK", 4)
    s = 10
    causal = torch.ones(s, s, dtype=torch.bool).triu(1).expand(2, 1, s, s).clone()
    batch_mod.check_causal_attention_mask(causal, s)
    for i, j in [(0, 1), (9, 3), (5, 5), (7, 8)]:  # hide a visible entry or show a hidden one
        bad = causal.clone()
        bad[1, 0, i, j] = ~bad[1, 0, i, j]
        with pytest.raises(ValueError, match="not the plain causal mask"):
            batch_mod.check_causal_attention_mask(bad, s)


def test_the_device_side_mask_check_has_a_message_cuda_accepts(monkeypatch):
    """Off the CPU the check stays on the device (torch._assert_async), whose CUDA kernel refuses a
    message of 255 characters or more ("Message length must be smaller than 255": it stopped
    Megatron-LM's pretrain_gpt.py on an H100 at the first batch). Run on the meta device with the
    assert recorded."""
    from megatron_burst.megatron import batch as batch_mod

    messages = []
    monkeypatch.setattr(torch, "_assert_async", lambda cond, msg: messages.append((cond.device.type, msg)))
    s = 6
    mask = torch.ones(s, s, dtype=torch.bool).triu(1).expand(1, 1, s, s).to("meta")
    batch_mod.check_causal_attention_mask(mask, s)
    assert len(messages) == 1 and messages[0][0] == "meta"
    assert len(messages[0][1]) < 255 and "not the plain causal mask" in messages[0][1]


def test_positions_and_rope_rows_are_built_once():
    """Slicing indices and RoPE rows are cached per (sequence, rank, layout, device): the same
    tensor comes back, so no host-to-device index copy happens per call."""
    from megatron_burst.masks.layout import layout_indices_on

    a = layout_indices_on(24, 1, 2, "striped", 1, torch.device("cpu"))
    assert a is layout_indices_on(24, 1, 2, "striped", 1, torch.device("cpu"))
    assert a.tolist() == list(range(1, 24, 2))
    for res in run_ranks(2, rope_rows_cached):
        assert res
