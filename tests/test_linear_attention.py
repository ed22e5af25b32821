"""megatron_burst.linear_attention (LASP-2, LASP-1) on W gloo ranks equals the token-by-token
recurrence over the whole sequence -- output and every gradient, every decay form, causal and
bidirectional, every layout -- and sends exactly the bytes LASP-2's analysis says, whatever the
sequence length."""
import pytest
import torch

from harness import run_ranks
from linear_cases import B, DK, DV, H, LOCAL, bad_input_messages, check_errors, run_case

GFORMS = [None, "head", "token", "channel"]


@pytest.mark.parametrize("gform", GFORMS)
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_lasp2_matches_the_recurrence(world_size, layout, gform):
    stripe = 64 if layout == "striped" else 1
    for rank, res in enumerate(run_ranks(world_size, run_case, "lasp2", layout, True, gform, LOCAL[layout],
                                         stripe=stripe)):
        check_errors(res, what=f"lasp2 W={world_size} {layout} g={gform} rank {rank}")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_bidirectional_matches(world_size, layout):
    for res in run_ranks(world_size, run_case, "lasp2", layout, False, None, 10):
        check_errors(res, what=f"bidirectional W={world_size} {layout}")


@pytest.mark.parametrize("causal,gform", [(True, None), (True, "channel"), (True, "head"), (False, None)])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_lasp1_matches(layout, causal, gform):
    for world_size in (2, 3):
        for res in run_ranks(world_size, run_case, "lasp1", layout, causal, gform, 70 if causal else 10):
            check_errors(res, what=f"lasp1 W={world_size} {layout} causal={causal} g={gform}")


def test_bf16_inputs_keep_fp32_states():
    """bf16 q, k, v: states and sums in fp32, the output rounded once -- within 1e-2 of the largest
    reference value (bf16 carries 8 bits; accumulating the state in bf16 would not stay there)."""
    for res in run_ranks(2, run_case, "lasp2", "zigzag", True, "channel", 70, torch.bfloat16):
        assert res["dtype"] == "torch.bfloat16"
        check_errors(res, tol=1e-2, what="bf16")


def _lasp2_bytes(world_size, segments, dkg, phase):
    state = B * H * DK * DV
    per_rank = segments * (state + (B * H * dkg if phase == "forward" and dkg else 0))
    return (world_size - 1) * per_rank * 4  # fp32 states


@pytest.mark.parametrize("gform,dkg", [(None, 0), ("head", 1), ("channel", DK)])
def test_lasp2_bytes_are_exact_and_independent_of_sequence_length(gform, dkg):
    """One all-gather of (state, decay) per segment forward and one of the state gradients backward:
    (W - 1) x this rank's part, equal at 70 and 210 tokens per rank."""
    for layout, segments in (("contiguous", 1), ("zigzag", 2)):
        seen = []
        for local_len in (70, 210):
            for res in run_ranks(4, run_case, "lasp2", layout, True, gform, local_len):
                assert res["bytes"] == {"forward": _lasp2_bytes(4, segments, dkg, "forward"),
                                        "backward": _lasp2_bytes(4, segments, dkg, "backward")}, (layout, res["bytes"])
                seen.append(res["bytes"])
        assert seen[0] == seen[-1]


def test_lasp1_sends_each_state_once_along_the_chain():
    """Contiguous, W = 4: every rank but the last sends one state forward, every rank but the first
    one state gradient backward."""
    state = B * H * DK * DV * 4
    for rank, res in enumerate(run_ranks(4, run_case, "lasp1", "contiguous", True, "head", 70)):
        assert res["bytes"] == {"forward": state if rank < 3 else 0, "backward": state if rank > 0 else 0}


def test_bad_inputs_raise_before_any_collective():
    for messages, moved, group_ok in run_ranks(2, bad_input_messages):
        assert group_ok and moved == 0
        assert "stripe=1" in messages["token_stripes"] and "zigzag" in messages["token_stripes"]
        assert "causal=True" in messages["bidirectional_decay"]
        assert "g (3,)" in messages["decay_shape"]
        assert "lasp2" in messages["algo"]
        assert "divisible" in messages["seq"]
        assert messages["kv_mismatch"] is not None
