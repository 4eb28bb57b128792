"""model.gradient_accumulation_fusion through `bridge pretrain` on the CPU (bridge_cli/models/wgrad_in_graph.py and the
grouped experts of bridge_cli/models/moe_experts.py): weight
gradients added into main_grad by the linears' backward train as autograd's, eager and compiled (where no layer breaks
at a linear any more), in one process with the output layer sharing the embedding and with an embedding of its own
(whose gradient goes into main_grad too, bridge_cli/models/embedding_wgrad.py), over two tensor-parallel ranks and over
two data-parallel ranks whose gradient all-reduce overlaps the backward."""

from __future__ import annotations

import pytest

from tests.conftest import bridge, torchrun
from tests.integration.test_pretrain_cpu import losses

RUN = ["recipe=tiny", "train.train_iters=4", "logger.log_interval=1", "train.eval_iters=0", "train.global_batch_size=16"]
FUSION = ["model.gradient_accumulation_fusion=true"]


@pytest.mark.slow
def test_fused_weight_gradients_train_as_autograds_eager_and_compiled():
    compiled = ["model.compile_layers=true"]
    runs = [bridge("pretrain", *RUN, *extra, env={"TORCH_LOGS": "graph_breaks"})
            for extra in ([], FUSION, FUSION + compiled)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    reference, *fused = (losses(run.stdout) for run in runs)
    assert len(reference) == 4
    for curve in fused:
        assert curve == pytest.approx(reference, rel=1e-5)
    assert "Graph break" not in runs[2].stderr, runs[2].stderr[-3000:]


ONE_PROCESS = {
    # the embedding's rows go into main_grad in its backward (bridge_cli/models/embedding_wgrad.py)
    "untied_embedding": ["model.share_embeddings_and_output_weights=false"],
    # GPT-2-style linears with biases (the bias gradient is the backward's column sum)
    "biased_linears": ["model.add_bias_linear=true"],
}


@pytest.mark.slow
@pytest.mark.parametrize("model", ONE_PROCESS, ids=list(ONE_PROCESS))
def test_fused_weight_gradients_train_as_autograds_in_one_process(model):
    runs = [bridge("pretrain", *RUN, *ONE_PROCESS[model], *extra) for extra in ([], FUSION)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    reference, fused = (losses(run.stdout) for run in runs)
    assert len(reference) == 4 and fused == pytest.approx(reference, rel=1e-5)


LAYOUTS = {
    "tp2": ["model.tensor_model_parallel_size=2", "model.share_embeddings_and_output_weights=false"],
    # the wrapper's hooks launch each bucket's all-reduce once its gradients are in: the flagged weights count
    # (the embedding's too: untied, its gradient goes into main_grad)
    "dp2_overlapped": ["ddp.overlap_grad_reduce=true", "model.share_embeddings_and_output_weights=false"],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_fused_weight_gradients_over_two_ranks(layout):
    runs = [torchrun(2, "pretrain", *RUN, *LAYOUTS[layout], *extra) for extra in ([], FUSION)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    reference, fused = (losses(run.stdout) for run in runs)
    assert len(reference) == 4 and fused == pytest.approx(reference, rel=1e-5)


MOE = ["recipe=tiny_moe", "train.train_iters=4", "logger.log_interval=1", "train.eval_iters=0"]


@pytest.mark.slow
@pytest.mark.parametrize("ranks, layout", [(1, []), (2, ["model.expert_model_parallel_size=2",
                                                          "ddp.overlap_grad_reduce=true"])], ids=["one_process", "ep2"])
def test_grouped_experts_add_their_weight_gradients_into_main_grad_as_autograd(ranks, layout):
    """Grouped experts (bridge_cli/models/moe_experts.py) flagged at the wrap: their weight gradients go into
    main_grad (on the CPU one GEMM per expert) and the wrapper skips the placeholder, in one process and with the
    experts split over two ranks whose expert and dense buckets reduce during the backward."""
    launch = (lambda *args: bridge(*args)) if ranks == 1 else (lambda *args: torchrun(ranks, *args))
    runs = [launch("pretrain", *MOE, *layout, *extra) for extra in (["model.gradient_accumulation_fusion=false"], FUSION)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    reference, fused = (losses(run.stdout) for run in runs)
    assert len(reference) == 4 and fused == pytest.approx(reference, rel=1e-5)
