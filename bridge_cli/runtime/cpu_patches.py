"""The one place that redirects megatron-core's hard-coded CUDA calls on a machine without CUDA.

megatron-core assumes a GPU in a handful of spots that sit on the CPU training path. Each is
replaced here, process-wide, by :func:`apply_cpu_patches`, which does nothing when CUDA is
available and nothing the second time it runs. Symbol by symbol:

``torch.cuda.current_device``
    Used as the ``device=`` of tensors megatron-core allocates itself: DDP grad buffers
    (``distributed.param_and_grad_buffer``), rotary embeddings, tensor-parallel linear weights,
    pipeline p2p receive buffers. A CPU-only torch raises; redirected to ``cpu``.
``torch.cuda.synchronize``
    Called by DDP, pipeline p2p and dist-checkpointing to order work against the GPU stream.
    On the CPU every op is already synchronous; redirected to a no-op.
``torch.cuda.current_stream``
    From megatron-core 0.17 on, DDP's ``start_grad_sync`` takes the current stream to wait on
    CUDA-graph events before every grad all-reduce. Redirected to a stream stand-in whose
    waits are no-ops, for the same reason as ``synchronize``.
``megatron.core.pipeline_parallel.schedules.torch``
    Every schedule allocates its token counter with ``torch.zeros(..., device="cuda")`` and
    ``forward_step`` wraps the forward in ``torch.autocast("cuda")`` when autocast is on. The
    module's ``torch`` name is replaced by a view of ``torch`` (:class:`_TorchOnCPU`) whose
    ``zeros``, ``ones`` and ``autocast`` map ``cuda`` to ``cpu``; every other name is the real
    one.
``megatron.core.transformer.utils.torch``
    The local spec's softmax builds its default causal mask (and the sliding-window one) with
    ``torch.ones(..., device="cuda")``; the same view of ``torch``, whose ``ones`` maps ``cuda``
    to ``cpu``.
``megatron.core.models.common.embeddings.rope_utils.torch``
    Under context parallelism ``get_pos_emb_on_this_cp_rank`` cuts the RoPE table with an index
    built by ``torch.tensor(..., pin_memory=True)``, which needs CUDA; the same view of ``torch``,
    whose ``tensor`` drops ``pin_memory``.
``megatron.core.tensor_parallel.random``: ``torch``, ``_get_cuda_rng_state``, ``_set_cuda_rng_state``
    The CUDA RNG tracker keeps one generator state per parallel role (model-parallel init,
    dropout under sequence parallelism, the local spec's attention dropout) and activation
    recomputation saves and restores the device generator; all of it reads and writes the
    CUDA generator. Redirected to the CPU default generator, the one CPU dropout draws from,
    so ``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()`` and
    ``tensor_parallel.checkpoint`` work unchanged.
``megatron.core.pipeline_parallel.p2p_communication._batched_p2p_ops``
    With ``batch_p2p_comm`` (the default) a pipeline step posts send-prev, recv-prev,
    send-next, recv-next as one batch. NCCL groups them; gloo matches them by posting order per
    peer, so where the previous and next stage are the same rank (2 stages, interleaved) a
    rank's gradient lands in its peer's activation buffer. Redirected to ``_p2p_ops``, the
    unbatched path with the same arguments, which orders the pair by rank parity and puts one
    direction on another communicator; its requests come back as the list callers expect.
``megatron.core.rerun_state_machine.torch``
    The rerun state machine all-reduces its re-run and checkpoint requests as
    ``torch.tensor(..., device="cuda")`` and, before each step it may re-run, saves and restores
    the CUDA generator with the default ones. The same view of ``torch``, whose ``tensor`` maps
    ``cuda`` to ``cpu`` and whose CUDA generator is the CPU default generator.
``megatron.core.transformer.moe``: ``token_dispatcher.torch``, ``shared_experts.torch``, ``moe_utils.torch``
    The alltoall token dispatcher creates a ``torch.cuda.Stream`` when built and, each
    forward, copies its split sizes to the host on that side stream and waits on an event;
    overlapped shared experts run on their own stream the same way; the MoE loss tracker
    allocates its per-layer values with ``torch.zeros(..., device="cuda")``. Those modules'
    ``torch`` names become the same view of ``torch``, whose ``cuda.Stream``/``cuda.Event``
    are host stand-ins, ``cuda.stream(...)`` enters nothing, and ``zeros`` maps ``cuda`` to
    ``cpu``: on the CPU every op has already finished when the next starts.
``megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu``
    The alltoall dispatcher turns its per-rank split sizes into host numpy arrays with this
    helper before ``all_to_all_single``, but the helper converts CUDA tensors only: on the CPU
    the splits stay tensors, which ``all_to_all_single`` rejects. Redirected to a version that
    also converts CPU tensors (numpy when asked), so expert parallelism runs over gloo.
``torch.Tensor.cuda``
    With tied embeddings and pipeline stages, ``LanguageModule.setup_embeddings_and_output_layer``
    moves the last stage's copy of the embedding with ``weight.data.cuda()`` before all-reducing
    it with the first stage's. Without CUDA that call can only raise; it returns the tensor as is.
``megatron.core.optimizer.FP32Optimizer`` and ``megatron.core.optimizer.ChainedOptimizer``
    ``get_megatron_optimizer`` wraps its torch optimizer in these; they keep the loss scale
    on ``cuda`` and compute grad norms, clipping and zero counts with ``cuda`` tensors. The
    names are rebound to the subclasses in :mod:`bridge_cli.runtime.cpu_optimizer`, which
    override only those parts, so ``get_megatron_optimizer`` keeps building param groups,
    process groups and checkpoint state exactly as on the GPU.
"""

from __future__ import annotations

import contextlib
import types

import torch

_applied = False


def apply_cpu_patches() -> None:
    """Redirect megatron-core's CUDA-only calls to the CPU; no-op with CUDA or when done."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    from megatron.core import optimizer as mcore_optimizer
    from megatron.core import rerun_state_machine
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe import moe_utils, shared_experts, token_dispatcher

    from bridge_cli.runtime.cpu_optimizer import CPUChainedOptimizer, CPUFP32Optimizer

    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _synchronize
    torch.cuda.current_stream = _current_stream
    torch.Tensor.cuda = _stay_on_cpu
    schedules.torch = _TorchOnCPU(torch)
    transformer_utils.torch = _TorchOnCPU(torch)
    rope_utils.torch = _TorchOnCPU(torch)
    mcore_random.torch = _TorchOnCPU(torch)
    rerun_state_machine.torch = _TorchOnCPU(torch)
    for module in (token_dispatcher, shared_experts, moe_utils):
        module.torch = _TorchOnCPU(torch)
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    mcore_random._get_cuda_rng_state = _get_rng_state
    mcore_random._set_cuda_rng_state = _set_rng_state
    p2p_communication._batched_p2p_ops = _unbatched(p2p_communication._p2p_ops)
    mcore_optimizer.FP32Optimizer = CPUFP32Optimizer
    mcore_optimizer.ChainedOptimizer = CPUChainedOptimizer
    _applied = True


def _stay_on_cpu(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def _current_device() -> torch.device:
    return torch.device("cpu")


def _synchronize(device=None) -> None:
    return None


class _HostEvent:
    """An event on the host stream: it has always happened already."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _HostStream:
    """The CPU's one implicit stream: everything is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event=None) -> _HostEvent:
        return event or _HostEvent()


def _current_stream(device=None) -> _HostStream:
    return _HostStream()


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


def _get_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _unbatched(p2p_ops):
    def batched_p2p_ops(**kwargs) -> list:
        return list(p2p_ops(**kwargs).values())

    return batched_p2p_ops


def _host(device):
    """``device`` with any CUDA device replaced by the CPU."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _TorchOnCPU(types.ModuleType):
    """``torch`` with CUDA allocations, autocast and the CUDA generator landing on the CPU."""

    def __init__(self, real: types.ModuleType):
        super().__init__(real.__name__, real.__doc__)
        self._real = real
        self.cuda = _CudaOnCPU(real.cuda)

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def zeros(self, *size, device=None, **kwargs):
        return self._real.zeros(*size, device=_host(device), **kwargs)

    def ones(self, *size, device=None, **kwargs):
        return self._real.ones(*size, device=_host(device), **kwargs)

    def tensor(self, data, *args, device=None, pin_memory: bool = False, **kwargs):
        return self._real.tensor(data, *args, device=_host(device), **kwargs)

    def autocast(self, device_type: str, *args, **kwargs):
        return self._real.autocast("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


class _CudaOnCPU(types.ModuleType):
    """``torch.cuda`` whose generator functions act on the CPU default generator, and whose
    streams and events are the host's (already ordered)."""

    Stream = _HostStream
    Event = _HostEvent

    def __init__(self, real: types.ModuleType):
        super().__init__(real.__name__, real.__doc__)
        self._real = real

    def stream(self, stream) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def current_stream(self, device=None) -> _HostStream:
        return _HostStream()

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def get_rng_state(self, device=None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(new_state)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
