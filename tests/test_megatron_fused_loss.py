"""GPT with --fused-lm-loss: the training step equals the unfused one (loss and every gradient),
the fused backward path is the one taken, and evaluation still returns logits."""
import pytest
import torch

from harness import run_ranks
from test_megatron_model import _assert_matches, build_and_step, fixed_batch, full_grads


def fused_step(tp: int, cp: int, extra=None) -> dict:
    from megatron_burst.loss import backward_paths

    before = dict(backward_paths)
    loss, model, groups = build_and_step(tp, cp, extra)
    paths = {k: backward_paths[k] - before.get(k, 0) for k in backward_paths}
    model.eval()
    with torch.no_grad():
        batch = fixed_batch(24)
        logits = model(batch["tokens"][:, :24 // cp], batch["position_ids"][:, :24 // cp], None)
    return {"loss": loss, "grads": full_grads(model, groups), "paths": paths, "eval_shape": tuple(logits.shape),
            "fused": model.fused_lm_loss}


@pytest.fixture(scope="module")
def unfused_reference():
    return run_ranks(1, fused_step, 1, 1)[0]


def test_fused_equals_unfused_at_cp1(unfused_reference):
    res = run_ranks(1, fused_step, 1, 1, ["--fused-lm-loss"])[0]
    assert res["fused"] and not unfused_reference["fused"]
    _assert_matches(res, unfused_reference, "fused loss, CP=1")
    assert res["paths"].get("scaled", 0) == 1 and res["paths"].get("recompute", 0) == 0
    assert res["eval_shape"][-1] == unfused_reference["eval_shape"][-1]  # evaluation returns logits


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_fused_with_cp2_equals_unfused_cp1(unfused_reference, layout):
    for res in run_ranks(2, fused_step, 1, 2, ["--fused-lm-loss", "--cp-layout", layout]):
        _assert_matches(res, unfused_reference, f"fused loss, CP=2 {layout}")
        assert res["paths"].get("scaled", 0) == 1


def test_fused_with_tp2_cp2_equals_unfused_cp1(unfused_reference):
    """Vocabulary split over TP = 2 (tied embedding/output weight) with CP = 2."""
    for res in run_ranks(4, fused_step, 2, 2, ["--fused-lm-loss"]):
        _assert_matches(res, unfused_reference, "fused loss, TP=2 x CP=2")
        assert res["paths"].get("scaled", 0) == 1


def test_fused_with_untied_output_weight_tp2():
    ref = run_ranks(1, fused_step, 1, 1, ["--untie-embeddings-and-output-weights"])[0]
    for res in run_ranks(2, fused_step, 2, 1, ["--fused-lm-loss", "--untie-embeddings-and-output-weights"]):
        _assert_matches(res, ref, "fused loss, untied output weight, TP=2")
