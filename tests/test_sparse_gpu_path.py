"""The CUDA path of vertical-slash attention, emulated on CPU where the code branches on the
device: a CUDA call asks for no "gather" kernel (every visible pair is a Triton tile column, so
the plain-torch row gather is neither chosen nor warned about), and the planner's bit packing is
a handful of whole-tensor ops."""
import torch

from megatron_burst.algorithms.schedule import CPConfig
from megatron_burst.masks import vertical_slash as sparse
from megatron_burst.masks.vertical_slash import VerticalSlash, plan_pair
from megatron_burst.topology import CPTopology


def _config(pattern: VerticalSlash) -> CPConfig:
    return CPConfig(CPTopology(None, 0, 1, 1, None), "flat", "striped", 64, True, 1.0, pattern=pattern)


def _pattern(S: int, h: int, device) -> VerticalSlash:
    g = torch.Generator().manual_seed(0)
    vertical = torch.cat([torch.arange(4).expand(h, 4), torch.randint(0, S, (h, 6), generator=g)], 1)
    slash = torch.cat([torch.arange(16).expand(h, 16), torch.randint(16, S, (h, 5), generator=g)], 1)
    return VerticalSlash(vertical.to(device), slash.to(device))


def test_cuda_calls_ask_for_no_gather_kernel(monkeypatch):
    """mask_kinds follows the planner's split for the pattern's device: on CUDA (and any fused
    device: dense column 0) the kinds are ("sparse",); on CPU the scattered pairs are gathered."""
    assert _config(_pattern(256, 2, "cpu")).mask_kinds == ("sparse", "gather")
    assert _config(_pattern(256, 2, "meta")).mask_kinds == ("sparse",)  # meta: not CPU, as CUDA
    # the CPU planner emulating CUDA's split (dense column 0) yields no gather part either
    monkeypatch.setattr(sparse, "dense_column_for", lambda device: 0.0)
    pattern = _pattern(256, 2, "cpu")
    assert _config(pattern).mask_kinds == ("sparse",)
    pos = torch.arange(256)
    tiles, rows = plan_pair(pattern, 256, pos, pos)
    assert rows == () and tiles.tiles == 4


def test_cuda_kinds_choose_the_triton_kernel_without_a_slow_warning(monkeypatch):
    """choose() on CUDA kinds of a pattern call: no 'gather' in the request, so no SlowKernelWarning."""
    import warnings

    from megatron_burst.kernels import choice

    asked = []
    monkeypatch.setattr(choice, "_gpu_choice", lambda kind, *a: asked.append(kind) or "triton_block_sparse")
    monkeypatch.setattr(choice, "FUSED_DEVICE_TYPES", ("cpu",))  # take the CUDA branch on CPU tensors
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choice.choose(torch.device("cpu"), torch.bfloat16, 128, _config(_pattern(256, 2, "meta")).mask_kinds)
    assert asked == ["sparse"]


def _pack_bits_per_bit(mask: torch.Tensor) -> torch.Tensor:
    """The definition, bit by bit: column c at bit c % 32 of word c // 32 (two's complement int32)."""
    n = mask.shape[-1]
    words = -(-n // 32)
    out = torch.zeros(*mask.shape[:-1], words, dtype=torch.int64)
    for c in range(n):
        out[..., c // 32] |= mask[..., c].long() << (c % 32)
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)


def test_pack_bits_matches_the_bit_by_bit_definition():
    """pack_bits (weighted sums of 16-bit halves) equals the per-bit definition, the sign bit and a
    partial last word included, and unpack_bits inverts it."""
    g = torch.Generator().manual_seed(3)
    for n in (1, 31, 32, 33, 70):
        mask = torch.rand(3, 5, n, generator=g) < 0.5
        mask[0, 0] = True  # every bit set: words of -1
        got = sparse.pack_bits(mask)
        assert got.dtype == torch.int32 and torch.equal(got, _pack_bits_per_bit(mask)), n
        assert torch.equal(sparse.unpack_bits(got, n), mask)
