"""megatron-core's DDP whose overlapped param all-gathers are waited on outside compiled layers.

With the distributed optimizer and ``ddp.overlap_param_gather``, megatron-core's DDP puts a forward pre-hook on
every module: before a module runs, the hook waits on the all-gather of its parameters' bucket and starts the next
bucket's. Under ``model.compile_layers`` each transformer layer's call is compiled whole, its modules' hooks with
it, so dynamo traced the hooks: each broke the layer's graph where it issued or waited on a collective, and its
lookup of the module's parameters in DDP's parameter-to-bucket dict became a guard on the identity of those
parameters, so every layer compiled graphs of its own where the layers otherwise share one. Two CPU ranks of the
tiny MoE recipe recompiled 48 times instead of 38 and took 3.6 times as long for their first step; the run that
found it, the MoE proxy (8 MoE layers) on 4 H100s, printed no step within 105 s.

:class:`GatherBeforeCompiledLayers` runs the same hooks, for each of a compiled layer's modules in module order,
just before the layer's compiled call and outside it: the layers compile as without overlap and their graphs hold
no hook. A layer now waits on all its buckets as it starts rather than module by module; the wait on its last one
still starts the next bucket's all-gather, which runs during this layer. The numbers do not change.
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel


class GatherBeforeCompiledLayers(DistributedDataParallel):
    """megatron-core's DDP; with overlapped param all-gathers, a module compiled in place (``Module.compile``, before
    the wrap) waits on its parameters before its compiled call, and the modules inside it have no hook."""

    def enable_forward_pre_hook(self):
        assert self.use_forward_hook and not self.remove_forward_pre_hook_handles
        hook = self._make_forward_pre_hook()
        compiled = [module for module in self.module.modules() if getattr(module, "_compiled_call_impl", None)]
        inside = {id(sub) for layer in compiled for sub in layer.modules() if sub is not layer}
        for module in self.module.modules():
            if id(module) in inside:
                continue
            if getattr(module, "_compiled_call_impl", None):
                handle = _GatherFirst(module, hook)
            else:
                handle = module.register_forward_pre_hook(hook)
            self.remove_forward_pre_hook_handles[module] = handle

    def disable_forward_pre_hook(self, param_sync: bool = True):
        assert self.use_forward_hook
        for handle in self.remove_forward_pre_hook_handles.values():
            handle.remove()
        self.remove_forward_pre_hook_handles.clear()
        if param_sync:
            with torch.no_grad():  # a state update, not differentiable compute (megatron-core 0.19 does the same)
                self.start_param_sync(force_sync=True)


class _GatherFirst:
    """Runs DDP's pre-hook for each of ``layer``'s modules before its compiled call; ``remove()`` undoes it."""

    def __init__(self, layer: torch.nn.Module, hook):
        self.layer, self.compiled = layer, layer._compiled_call_impl
        modules, compiled = list(layer.modules()), self.compiled

        def call(*args, **kwargs):
            for module in modules:
                hook(module)
            return compiled(*args, **kwargs)

        layer._compiled_call_impl = call

    def remove(self) -> None:
        self.layer._compiled_call_impl = self.compiled
