"""GPT with --fused-lm-loss: the training step equals the unfused one (loss and every gradient),
the fused backward path is the one taken, and evaluation still returns logits."""
import pytest
from megatron.core.models.gpt.gpt_model import GPTModel  # gpt_builder below constructs it by this name
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


def fused_step_into_main_grad(tp: int) -> dict:
    """build_and_step's step, with the model's config asking for Megatron's gradient-accumulation
    fusion and the tied embedding/output weight given a zero fp32 main_grad by hand (Megatron's
    DDP does both; its linear layers need CUDA for the fusion, so only the loss reads the flag).
    Returns the weight's gradient as Megatron's DDP hook sums it -- main_grad plus weight.grad,
    which the hook adds because Megatron marks a weight tied on one stage zero_out_wgrad -- and
    the flags the fused loss set."""
    import torch.distributed as dist

    from megatron_burst import train
    from test_megatron_model import VOCAB, small_args

    cpu = torch.device("cpu")
    args = small_args(["--tensor-model-parallel-size", str(tp), "--fused-lm-loss"])
    opts, topo = train.validate_args(args, dist.get_world_size())
    args.padded_vocab_size = VOCAB
    groups = train.init_parallel(topo)
    train.seed_everything(args.seed, cpu)
    model = train.build_model(args, opts, topo, groups, cpu)
    model.config.gradient_accumulation_fusion = True  # read by the fused loss at each call
    weight = model.shared_embedding_or_output_weight()
    weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
    weight.grad_added_to_main_grad = False
    train.loss_and_grads(model, [fixed_batch(24)], opts, groups, cpu)
    total = weight.main_grad + weight.grad  # DDP's hook: main_grad.add_(grad) when zero_out_wgrad
    parts = [torch.empty_like(total) for _ in range(tp)]
    dist.all_gather(parts, total, group=groups.tp)
    return {"grad": torch.cat(parts), "main_grad_max": weight.main_grad.abs().max().item(),
            "zero_out_wgrad": getattr(weight, "zero_out_wgrad", False),
            "grad_added_to_main_grad": weight.grad_added_to_main_grad,
            "name": next(n for n, p in model.named_parameters() if p is weight)}


@pytest.mark.parametrize("tp", [1, 2])
def test_gradient_accumulation_fusion_reaches_the_fused_loss(unfused_reference, tp):
    """config.gradient_accumulation_fusion: the output layer's part of the tied weight's gradient
    lands in main_grad, the embedding's part in weight.grad (the placeholder is zeros), and their
    sum is the unfused step's gradient of that weight."""
    for res in run_ranks(tp, fused_step_into_main_grad, tp):
        assert res["zero_out_wgrad"] and res["grad_added_to_main_grad"]
        ref = unfused_reference["grads"][res["name"]]
        assert res["main_grad_max"] > 0.1 * ref.abs().max().item()  # the loss did add into main_grad
        assert (res["grad"] - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def megatron_lm_builder_step(cp: int, extra=None) -> dict:
    """build_and_step, but the model comes the way Megatron-LM's patched pretrain_gpt.py gets it:
    a plain megatron.core GPTModel from a gpt_builder, wrapped by ``wrap_gpt_builder``."""
    import torch.distributed as dist

    from megatron_burst import train
    from megatron_burst.loss import backward_paths
    from megatron_burst.megatron import megatron_lm
    from test_megatron_model import VOCAB, small_args

    cpu = torch.device("cpu")
    args = small_args(["--context-parallel-size", str(cp)] + list(extra or []))
    opts, sizes = train.validate_args(args, dist.get_world_size())
    args.padded_vocab_size = VOCAB
    groups = train.init_parallel(sizes)

    def gpt_builder(a, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        return GPTModel(**train.gpt_model_kwargs(a, opts, sizes, groups, cpu, pre_process, post_process))

    builder = megatron_lm.wrap_gpt_builder(gpt_builder)  # swaps GPTModel by its global name (imported above)
    first_stage = builder(args, True, False)  # a pipeline stage without the output layer: no fused loss
    train.seed_everything(args.seed, cpu)
    model = builder(args, True, True, vp_stage=None)
    before = dict(backward_paths)
    loss = train.loss_and_grads(model, [fixed_batch(24)], opts, groups, cpu)
    train.allreduce_grads(model, groups)
    return {"loss": loss.item(), "grads": full_grads(model, groups), "cls": type(model).__name__,
            "first_stage_fused": first_stage.fused_lm_loss, "fused": model.fused_lm_loss,
            "paths": {k: backward_paths[k] - before.get(k, 0) for k in backward_paths}}


@pytest.mark.parametrize("cp,layout", [(1, "zigzag"), (2, "striped")])
def test_megatron_lm_builder_gets_the_fused_loss(unfused_reference, cp, layout):
    """--fused-lm-loss reaches a model built by Megatron-LM's gpt_builder (through the patch's
    wrap_gpt_builder) and its step equals the unfused one."""
    for res in run_ranks(cp, megatron_lm_builder_step, cp, ["--fused-lm-loss", "--cp-layout", layout]):
        assert res["cls"] == "BurstGPTModel" and res["fused"] and not res["first_stage_fused"]
        _assert_matches(res, unfused_reference, f"fused loss via Megatron-LM's builder, CP={cp} {layout}")
        assert res["paths"].get("scaled", 0) == 1 and res["paths"].get("recompute", 0) == 0


def test_as_burst_gpt_model_refuses_other_subclasses():
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_burst.megatron.model import as_burst_gpt_model

    class OtherGPT(GPTModel):
        def __init__(self):  # never built: the check comes first
            pass

    with pytest.raises(TypeError, match="OtherGPT.*--cp-algo none"):
        as_burst_gpt_model(OtherGPT(), cp_layout="zigzag", fused_lm_loss=True)
