"""megatron_burst.gated_delta_rule on W gloo ranks equals the token-by-token gated delta rule over the
whole sequence -- output and the gradients of q, k, v, g and beta, every layout -- and sends exactly
one all-gather of per-segment (A, B) maps forward and one of the state gradients backward, whatever
the sequence length."""
import pytest
import torch

from harness import run_ranks
from gdn_cases import B, DK, DV, H, bad_input_messages, run_gdn_case
from linear_cases import LOCAL, check_errors


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_gated_delta_rule_matches_the_recurrence(world_size, layout):
    stripe = 64 if layout == "striped" else 1
    for rank, res in enumerate(run_ranks(world_size, run_gdn_case, layout, LOCAL[layout], stripe=stripe)):
        assert set(res) >= {"out", "dq", "dk", "dv", "dg", "dbeta"}
        check_errors(res, what=f"gdn W={world_size} {layout} rank {rank}")


def test_long_segments_span_many_chunks_and_bshd():
    """200 tokens per rank (3 full chunks and a partial one) in the [b, s, h, d] format."""
    for res in run_ranks(2, run_gdn_case, "contiguous", 200, qkv_format="bshd"):
        check_errors(res, what="bshd 200")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fla_kernel_path_matches_the_recurrence(world_size, layout):
    """kernel='fla': the maps and their exchange in torch, the outputs by fla's API (here the
    reference behind it, see gdn_cases.fake_fla) entering each segment with the exchanged state;
    gradients reach q, k, v, g, beta through both, and the bytes are the torch path's."""
    stripe = 64 if layout == "striped" else 1
    for rank, res in enumerate(run_ranks(world_size, run_gdn_case, layout, LOCAL[layout], stripe=stripe,
                                         kernel="fla")):
        check_errors(res, what=f"fla W={world_size} {layout} rank {rank}")
        segments = {"contiguous": 1, "zigzag": 2, "striped": 2}[layout]
        assert res["bytes"] == {"forward": _gdn_bytes(world_size, segments, "forward"),
                                "backward": _gdn_bytes(world_size, segments, "backward")}


def test_bf16_inputs_keep_fp32_states():
    for res in run_ranks(2, run_gdn_case, "zigzag", 70, torch.bfloat16):
        assert res["dtype"] == "torch.bfloat16"
        check_errors(res, tol=2e-2, what="bf16")


def _gdn_bytes(world_size, segments, phase):
    per_segment = B * H * DK * DV + (B * H * DK * DK if phase == "forward" else 0)  # B (+ A forward)
    return (world_size - 1) * segments * per_segment * 4  # fp32 maps


def test_bytes_are_exact_and_independent_of_sequence_length():
    """Forward: one all-gather of (A [dk, dk], B [dk, dv]) per segment; backward: one of dS_in
    [dk, dv]; (W - 1) x this rank's part, equal at 70 and 210 tokens per rank."""
    for layout, segments in (("contiguous", 1), ("zigzag", 2)):
        seen = []
        for local_len in (70, 210):
            for res in run_ranks(4, run_gdn_case, layout, local_len):
                assert res["bytes"] == {"forward": _gdn_bytes(4, segments, "forward"),
                                        "backward": _gdn_bytes(4, segments, "backward")}, (layout, res["bytes"])
                seen.append(res["bytes"])
        assert seen[0] == seen[-1]


def test_bad_inputs_raise_before_any_collective():
    for messages, moved, group_ok in run_ranks(2, bad_input_messages):
        assert group_ok and moved == 0
        assert "stripe=1" in messages["token_stripes"] and "zigzag" in messages["token_stripes"]
        assert "g (2,)" in messages["g_shape"] and "per token and head" in messages["g_shape"]
        assert "beta (8, 1, 2, 4)" in messages["beta_shape"]
        assert "divisible" in messages["seq"]
        assert messages["kv_mismatch"] is not None
        assert "thd" in messages["format"]
        assert "triton" in messages["kernel"] and "torch" in messages["kernel"]


@pytest.mark.parametrize("layout,local_len,stripe,segments", [("contiguous", 10, 1, 1), ("zigzag", 10, 1, 2),
                                                               ("striped", 128, 64, 2)])
@pytest.mark.parametrize("world_size", [2, 3])
def test_previous_tokens_reach_every_segment_start(world_size, layout, local_len, stripe, segments):
    """The conv1d halo of Gated DeltaNet: each segment gets the 3 tokens before it from whichever
    rank holds them, the gradient goes back to them; bytes: (W - 1) x segments x 3 tokens each way."""
    from gdn_cases import previous_tokens_case

    for res in run_ranks(world_size, previous_tokens_case, layout, local_len, 3, stripe):
        assert res["halo"] == 0 and res["grad"] < 1e-6, res
        want = (world_size - 1) * segments * 3 * 2 * 3 * 4
        assert res["bytes"] == {"forward": want, "backward": want}
