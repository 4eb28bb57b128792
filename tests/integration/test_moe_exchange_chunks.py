"""model.moe_exchange_chunks on the CPU (gloo, fp32) under torchrun: the chunked token exchange gives the numbers of one
exchange, compiles without graph breaks of its own, keeps its overlap through inductor, and trains the same curve.

Each case but the last runs moe_exchange_chunks_worker.py (see its docstring). The auxiliary losses are computed by
the router before the exchange, so the first layer's are bitwise the same; each token's expert rows are summed in the
same order, so outputs and gradients are bitwise the same where the GEMMs see enough rows (the CPU's GEMM kernels for
1-3 rows sum in another order), and the expert weights' gradients add up chunk by chunk (1e-9 relative here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import REPO, python, torchrun
from tests.integration.test_moe_parallel_cpu import curve

WORKER = Path(__file__).with_name("moe_exchange_chunks_worker.py")
ENV = {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def measure(tmp_path, ranks: int, *args: str) -> list[dict]:
    result = python(str(WORKER), "--out", str(tmp_path), *args, nproc=ranks, env=ENV, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def assert_same_numbers(run: dict, bitwise_outputs: bool) -> None:
    assert run["layers"] == ["ChunkedExchangeMoELayer"] and run["missing"] == []
    assert len(run["grads"]) == 16
    for name, found in run["outputs"].items():
        if name.endswith("layer 0") or bitwise_outputs:  # the first layer's router sees the same input
            assert found["bitwise"], (name, found)
        assert found["relative"] < 1e-6, (name, found)
    for name, found in run["grads"].items():
        assert found["relative"] < 1e-6, (name, found)
        if bitwise_outputs and ".experts." not in name:
            assert found["bitwise"], (name, found)


@pytest.mark.slow
@pytest.mark.parametrize("ranks, layout, chunks, bitwise", [
    (2, ["--ep", "2"], [2, 4], {"2"}),
    (4, ["--ep", "4", "--topk", "4"], [2], set()),
    (4, ["--tp", "2", "--ep", "2", "--etp", "1"], [2], set()),  # sequence parallel: a rank routes its part
    (4, ["--ep", "2", "--etp", "2"], [2, 4], {"2", "4"}),  # each expert's FFN split over two ranks
], ids=["ep2", "ep4", "tp2_ep2", "etp2_ep2"])
def test_chunked_exchange_equals_one_exchange(tmp_path, ranks, layout, chunks, bitwise):
    """Bitwise at EP=2 in 2 chunks and at expert-TP=2 x EP=2; where chunks leave some experts 1-3 rows (EP=2 in 4
    chunks, EP=4, TP=2 x EP=2: 8 tokens a rank a chunk), the CPU's GEMM sums those in another order: within 4e-7."""
    for rank in measure(tmp_path, ranks, *layout, "--chunks", *map(str, chunks)):
        for count, run in rank.items():
            assert_same_numbers(run, bitwise_outputs=count in bitwise)


@pytest.mark.slow
def test_compiled_chunked_layers_break_no_graph_of_their_own(tmp_path):
    """On the CPU the compiled MoE layer breaks where megatron-core's router moves its weight (router.py) and where
    grouped experts read their counts on the host (moe_experts.py), chunked or not; the exchange adds none."""
    for rank in measure(tmp_path, 2, "--ep", "2", "--chunks", "2", "--compile"):
        run = rank["2"]
        assert run["layers"] == ["ChunkedExchangeMoELayer"] and run["missing"] == []
        assert run["graph_break_files"] and set(run["graph_break_files"]) <= {"router.py", "moe_experts.py"}, run
        for found in [*run["outputs"].values(), *run["grads"].values()]:
            assert found["relative"] < 1e-6, found


@pytest.mark.slow
def test_inductor_keeps_the_overlap_forward_and_backward(tmp_path):
    """The exchange of one layer run eagerly and compiled whole, as it is where the experts trace (CUDA, grouped GEMMs
    without model.gradient_accumulation_fusion): chunk 1's gather is issued before chunk 0's GEMM and waited on after
    it, chunk 0's reduce-scatter issued before chunk 1's GEMM; in the backward, the reduce-scatter of chunk 1's token
    gradients is issued before chunk 0's GEMMs and waited on after them."""
    for rank in measure(tmp_path, 2, "--ep", "2", "--chunks", "2", "--program-order"):
        assert all(found["relative"] < 1e-6 for found in rank["differences"].values()), rank["differences"]
        for forward, backward in (rank["orders"], rank["eager_orders"]):
            assert_overlapped(forward, backward)


def assert_overlapped(forward: list[str], backward: list[str]) -> None:
    """``forward``/``backward``: "gather <buffer>", "scatter <buffer>", "wait <buffer>" and "mm" events in order."""
    first_mm = forward.index("mm")
    second_mm = forward.index("mm", first_mm + 1)
    gathers = [event.split()[1] for event in forward if event.startswith("gather")]
    scatters = [event.split()[1] for event in forward if event.startswith("scatter")]
    second, first_scatter = gathers[-1], scatters[0]  # the routing map's, the probabilities', then the chunks'
    assert forward.index(f"gather {second}") < first_mm < forward.index(f"wait {second}") < second_mm, forward
    assert forward.index(f"scatter {first_scatter}") < second_mm < forward.index(f"wait {first_scatter}"), forward
    last_mm = max(i for i, event in enumerate(backward) if event == "mm")
    token_scatter = next(event.split()[1] for event in backward if event.startswith("scatter"))
    assert backward.index(f"scatter {token_scatter}") < last_mm < backward.index(f"wait {token_scatter}"), backward


@pytest.mark.slow
@pytest.mark.parametrize("chunks, main_grad", [(2, False), (4, True)], ids=["2_chunks", "4_chunks_main_grad"])
def test_compiled_moe_layer_keeps_the_overlap(tmp_path, chunks, main_grad):
    """The model's MoE layers compiled by model.compile_layers as on the GPU, each one graph with its grouped GEMMs
    (the worker's trace_as_on_cuda), and run eagerly: in inductor's forward code and in the eager run, every chunk's
    gather but the first is issued before the previous chunk's expert GEMMs and waited on after them, and every
    reduce-scatter but the last is issued before the next chunk's GEMMs and waited on after them; in the backward
    likewise, with each chunk's four GEMMs (two input gradients, two weight gradients, added into main_grad with
    ``main_grad``). No graph breaks, with the log line's pair counters counting inside the compiled layers; compiled
    within bf16's rounding of the eager run (the CPU's grouped GEMM is bf16)."""
    extra = ["--main-grad"] if main_grad else []
    for rank in measure(tmp_path, 2, "--ep", "2", "--chunks", str(chunks), "--layer-order", *extra):
        assert rank["graph_break_files"] == [], rank["graph_break_files"]
        assert len(rank["pairs_counted"]) == 2 and all(pairs > 0 for pairs in rank["pairs_counted"]), rank
        assert all(found["relative"] < 1e-4 for found in rank["outputs"].values()), rank["outputs"]
        assert all(found["relative"] < 1e-2 for found in rank["grads"].values()), rank["grads"]
        assert len(rank["forward"]) == 1 and len(rank["backward"]) >= 1  # one forward code for both layers
        for forward in rank["forward"]:
            assert overlapped(forward, gemms=2) == {"gather": chunks - 1, "scatter": chunks - 1}, forward
        for backward in rank["backward"]:
            assert overlapped(backward, gemms=4) == {"gather": chunks - 1, "scatter": chunks - 1}, backward
        layers = 2
        assert overlapped(rank["eager_forward"], gemms=2) == {"gather": layers * (chunks - 1),
                                                              "scatter": layers * (chunks - 1)}, rank["eager_forward"]
        assert overlapped(rank["eager_backward"], gemms=4) == {"gather": layers * (chunks - 1),
                                                               "scatter": layers * (chunks - 1)}, rank["eager_backward"]


def overlapped(events: list[str], gemms: int) -> dict[str, int]:
    """How many gathers and reduce-scatters of ``events`` ("gather <buffer>", "scatter <buffer>", "wait <buffer>",
    "gemm") have at least ``gemms`` GEMMs (one chunk's) between their issue and their first wait."""
    issued, found, count = {}, {"gather": 0, "scatter": 0}, 0
    for event in events:
        kind, _, buffer = event.partition(" ")
        if kind == "gemm":
            count += 1
        elif kind in found:
            issued[buffer] = (kind, count)
        elif kind == "wait" and buffer in issued:
            kind, at_issue = issued.pop(buffer)
            found[kind] += count - at_issue >= gemms
    return found


@pytest.mark.slow
def test_pretrain_with_chunked_exchange_follows_one_exchange():
    """`bridge pretrain recipe=tiny_moe` at EP=2 (a shared expert, z-loss, the first layer dense): the same losses."""
    from tests.integration.test_moe_parallel_cpu import SHORT

    one_exchange = curve(torchrun(2, "pretrain", *SHORT, "model.expert_model_parallel_size=2"))
    chunked = curve(torchrun(2, "pretrain", *SHORT, "model.expert_model_parallel_size=2",
                             "model.moe_exchange_chunks=2"))
    assert chunked[0] == pytest.approx(one_exchange[0], rel=1e-6, abs=0), (chunked, one_exchange)
    assert chunked[1] == pytest.approx(one_exchange[1], abs=1e-3)
