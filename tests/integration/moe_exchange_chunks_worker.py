"""bridge's token exchange in chunks (model.moe_exchange_chunks) against one exchange, on each rank of a torchrun job.

Used by test_moe_exchange_chunks.py. Builds the same small fp32 MoE model (CPU initialization: the same
weights at any layout) with one exchange and with each ``--chunks`` count, runs a forward and backward on this
rank's own tokens, and writes to ``--out``/rank<N>.json, per chunk count, the largest absolute difference of the
logits, of the auxiliary losses and of every parameter's gradient, relative to the largest value, and whether each is
bitwise equal. With ``--compile`` the chunked models' layers are compiled (model.compile_layers) and the source
files of dynamo's graph breaks are listed.

``--program-order`` instead compiles one MoE layer's exchange whole (its experts replaced by a traceable GEMM: on
the CPU grouped experts read their counts on the host, a graph break) with the layer's compile options, checks it
against the same code run eagerly, and writes the order in which the eager run and inductor's forward and backward
code issue the collectives, wait on them and run the GEMMs.

``--layer-order`` compiles the model's layers with model.compile_layers as the GPU does, each MoE layer one graph with
its grouped GEMMs (:func:`trace_as_on_cuda`), and writes the order of the collectives, waits and expert GEMMs in
inductor's forward and backward code of the MoE layer and in the same layer run eagerly; ``--main-grad`` adds the
expert weight gradients into ``main_grad`` in the graph (model.gradient_accumulation_fusion, as the MoE proxy runs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from megatron.core import parallel_state as ps

from bridge_cli.runtime.distributed import destroy_distributed, init_distributed
from tests.integration import moe_dispatch_worker
from tests.integration.moe_dispatch_worker import BATCH, SEQ, VOCAB


def build(args, chunks: int):
    """moe_dispatch_worker's model, with a z-loss and ``chunks`` exchanges."""
    return moe_dispatch_worker.build(args, args.tp > 1, moe_token_dispatcher_type="alltoall", moe_z_loss_coeff=1e-3,
                                     moe_exchange_chunks=chunks)


def forward_backward(model, forward_log=contextlib.nullcontext(), backward_log=contextlib.nullcontext()):
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    clear_aux_losses_tracker()
    seed = 1 + ps.get_data_parallel_rank()  # each data-parallel rank its own tokens; tensor-parallel ranks the same
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    model.zero_grad()
    with forward_log:
        logits = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None)
    with backward_log:
        logits.float().square().mean().backward()
    aux = {f"aux {name} layer {layer}": value.clone() for name, entry in get_moe_layer_wise_logging_tracker().items()
           for layer, value in enumerate(entry["values"])}
    return ({"logits": logits.detach(), **aux},
            {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})


def differences(ours: dict, theirs: dict) -> dict:
    def relative(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    return {name: {"relative": relative(ours[name], theirs[name]), "bitwise": torch.equal(ours[name], theirs[name])}
            for name in theirs}


class GraphBreakSites(logging.Handler):
    """The source files dynamo reports graph breaks in (its graph_breaks log)."""

    def __init__(self):
        super().__init__()
        self.files = set()
        torch._logging.set_logs(graph_breaks=True)
        for name in logging.root.manager.loggerDict:
            if name.endswith("__graph_breaks"):
                logging.getLogger(name).addHandler(self)

    def emit(self, record):
        found = re.search(r"in user code at (\S+?):\d+", record.getMessage())
        if found:
            self.files.add(Path(found.group(1)).name)


def program_order(args) -> dict:
    """One layer's exchange compiled whole against eager, and the order of inductor's collectives, waits and GEMMs."""
    from torch._inductor.utils import run_and_get_code

    from bridge_cli.models.regional_compile import _layer_options

    layer = build(args, args.chunks[0]).decoder.layers[0]
    dispatcher = layer.mlp.token_dispatcher
    weight = torch.randn(64, 64, requires_grad=True)

    def experts(x, tokens_per_expert, probs):
        return (x @ weight) * probs.unsqueeze(-1), None

    def exchange(hidden, probs, routing_map):
        hidden, probs = dispatcher.dispatch_preprocess(hidden, routing_map, probs)  # as the MoE layer calls it first
        return dispatcher.experts_in_chunks(hidden, probs, experts)

    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    hidden = torch.randn(32, 64, generator=generator, requires_grad=True)
    scores = torch.randn(32, 8, generator=generator)
    routing_map = torch.zeros(32, 8, dtype=torch.bool).scatter_(1, scores.topk(args.topk, dim=1).indices, True)
    probs = (scores.softmax(-1) * routing_map).requires_grad_()

    def step(fn, forward_log=contextlib.nullcontext(), backward_log=contextlib.nullcontext()):
        hidden.grad = probs.grad = weight.grad = None
        with forward_log:
            out = fn(hidden, probs, routing_map)
        with backward_log:
            out.square().sum().backward()
        return {"out": out.detach(), "hidden": hidden.grad, "probs": probs.grad, "weight": weight.grad}

    eager_forward, eager_backward = EagerOrder(), EagerOrder()
    eager = step(exchange, eager_forward, eager_backward)
    compiled = torch.compile(exchange, fullgraph=True, dynamic=False, **_layer_options(layer))
    ours, codes = run_and_get_code(lambda: step(compiled))
    orders = [code_events(code, compute=_MM, name="mm") for code in codes]
    return {"differences": differences(ours, eager), "orders": orders,
            "eager_orders": [eager_forward.events, eager_backward.events]}


def trace_as_on_cuda(main_grad: bool) -> None:
    """Let a MoE layer compile whole on the CPU as it does on an H100. megatron-core's router moves a weight it finds
    on the CPU to the GPU by assigning ``.data``, which dynamo cannot trace (on the GPU the weight is there already),
    and grouped experts run torch._grouped_mm only on CUDA in bf16 (elsewhere a loop that reads the counts on the
    host): here the router skips the move and the experts run the CPU's grouped GEMM in bf16, whose fake kernel takes
    only bf16. ``main_grad``: the experts add their weight gradients into ``main_grad`` (the weight's own gradient is
    a placeholder), as under model.gradient_accumulation_fusion with a data-parallel wrapper."""
    from megatron.core.transformer.moe import router

    from bridge_cli.models import moe_experts

    def gating(self, x):
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, x.dtype)
        return router.router_gating_linear(x, self.weight, self.bias, dtype)

    def grouped_mm(x, weight, offsets):
        return torch._grouped_mm(x.bfloat16(), weight.bfloat16().transpose(1, 2), offs=offsets).to(x.dtype)

    router.Router.gating = gating
    moe_experts._grouped_mm_supported = lambda x, weight: True
    moe_experts._grouped_mm = grouped_mm
    if main_grad:
        def project(self, linear, x, tokens_per_expert):
            weight = self.weight1 if linear == "linear_fc1" else self.weight2
            return moe_experts.grouped_linear(x, weight, tokens_per_expert, into_main_grad=True)

        moe_experts.GroupedGemmExperts.project = project


def give_main_grads(model) -> None:
    """An fp32 ``main_grad`` for each expert weight, flagged as the data-parallel wrapper and
    :func:`~bridge_cli.models.moe_experts.flag_main_grad_weights` leave it."""
    from bridge_cli.models.moe_experts import GroupedGemmExperts

    for experts in model.modules():
        if isinstance(experts, GroupedGemmExperts):
            for weight in (experts.weight1, experts.weight2):
                weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)
                weight.grad_added_to_main_grad = True


def layer_order(args) -> dict:
    """The model's layers compiled as on the GPU against the same model run eagerly, and the order of the MoE layer's
    collectives, waits and expert GEMMs in inductor's forward and backward code and in the eager run."""
    from torch._inductor.utils import run_and_get_code

    from bridge_cli.models.moe_dispatch import expert_pair_counters
    from bridge_cli.models.regional_compile import compile_layers

    trace_as_on_cuda(args.main_grad)
    models = [build(args, args.chunks[0]) for _ in range(2)]
    for model in models if args.main_grad else ():
        give_main_grads(model)
    eager_forward, eager_backward = EagerOrder(), EagerOrder()
    outputs, grads = forward_backward(models[0], eager_forward, eager_backward)
    model = models[1]
    counters, _ = expert_pair_counters([model])  # made before the first compiled call, as the training logger does
    sites = GraphBreakSites()
    compile_layers([model])
    (their_outputs, their_grads), codes = run_and_get_code(lambda: forward_backward(model))
    for name, weight in models[0].named_parameters() if args.main_grad else ():
        if hasattr(weight, "main_grad"):  # its .grad a placeholder
            grads[name] = weight.main_grad
            their_grads[name] = model.get_parameter(name).main_grad
    # each MoE layer's forward (the second recompiles on its layer number), then the backward (the second layer's,
    # the same graph, may come from inductor's cache)
    forward = [code_events(code) for code in codes if "gemm" in code_events(code) and "tangents_" not in code]
    backward = [code_events(code) for code in codes if "gemm" in code_events(code) and "tangents_" in code]
    return {"outputs": differences(their_outputs, outputs), "grads": differences(their_grads, grads),
            "graph_break_files": sorted(sites.files), "forward": forward, "backward": backward,
            "pairs_counted": [int(counter.sum()) for counter in counters],
            "eager_forward": eager_forward.events, "eager_backward": eager_backward.events}


_COLLECTIVE = (r"(\w+) = torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor)\.default\("
               r"|_c10d_functional\.wait_tensor\.default\((\w+)\)")
_GEMM = (r"(?:extern_kernels\._grouped_mm|torch\.ops\.aten\._grouped_mm\.default)\("
         r"|torch\.ops\.bridge\.accumulate_grouped_wgrad\.default\(")
"""A grouped GEMM, or a weight gradient's added into main_grad."""
_MM = r"extern_kernels\.mm\("
"""A plain GEMM (the CPU's experts, one per expert)."""


def code_events(code: str, compute: str = _GEMM, name: str = "gemm") -> list[str]:
    """"gather <buffer>", "scatter <buffer>", "wait <buffer>" and ``name`` (each match of ``compute``: by default a
    grouped GEMM, or a weight gradient's added into main_grad) in the order inductor's generated ``call`` runs them."""
    event = re.compile(f"{_COLLECTIVE}|{compute}")
    events = []
    for line in code.split("def call(", 1)[-1].splitlines():
        found = event.search(line)
        if not found or line.lstrip().startswith(("#", "assert")):
            continue
        if found.group(2):
            events.append(f"{'gather' if found.group(2).startswith('all') else 'scatter'} {found.group(1)}")
        elif found.group(3):
            events.append(f"wait {found.group(3)}")
        else:
            events.append(name)
    return events


class EagerOrder(TorchDispatchMode):
    """The collectives, waits and GEMMs run eagerly, in order, named as :func:`program_order` names inductor's."""

    def __init__(self):
        super().__init__()
        self.events, self.names, self.issued = [], {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.name()
        if name in ("_c10d_functional::all_gather_into_tensor", "_c10d_functional::reduce_scatter_tensor"):
            self.names[id(out)] = f"buf{self.issued}"  # ids of freed outputs come back: a count names each anew
            self.issued += 1
            kind = "gather" if "gather" in name else "scatter"
            self.events.append(f"{kind} {self.names[id(out)]}")
        elif name == "_c10d_functional::wait_tensor":
            self.events.append(f"wait {self.names.get(id(args[0]), '?')}")
        elif name == "aten::mm":
            self.events.append("mm")
        elif name in ("aten::_grouped_mm", "bridge::accumulate_grouped_wgrad"):
            self.events.append("gemm")
        return out


def main() -> None:
    parser = moe_dispatch_worker.arguments()
    parser.add_argument("--chunks", type=int, nargs="+", default=[2])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--program-order", action="store_true")
    parser.add_argument("--layer-order", action="store_true")
    parser.add_argument("--main-grad", action="store_true")
    args = parser.parse_args()
    init_distributed("gloo", 2, args.tp, 1, expert_model_parallel_size=args.ep, expert_tensor_parallel_size=args.etp)
    if args.program_order or args.layer_order:
        result = program_order(args) if args.program_order else layer_order(args)
        (args.out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result))
        destroy_distributed()
        return
    outputs, grads = forward_backward(build(args, 1))
    result = {}
    for chunks in args.chunks:
        model = build(args, chunks)
        layers = {type(layer.mlp).__name__ for layer in model.decoder.layers}
        if args.compile:
            from bridge_cli.models.regional_compile import compile_layers

            sites = GraphBreakSites()
            compile_layers([model])
        their_outputs, their_grads = forward_backward(model)
        result[chunks] = {"layers": sorted(layers), "outputs": differences(their_outputs, outputs),
                          "grads": differences(their_grads, grads), "missing": sorted(set(grads) ^ set(their_grads))}
        if args.compile:
            result[chunks]["graph_break_files"] = sorted(sites.files)
    (args.out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
