"""Checkpoint section: where and how checkpoints are saved and loaded."""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from bridge_cli.config.fields import one_of


@dataclass
class CheckpointConfig:
    """Saving and loading checkpoints."""

    save: Optional[str] = None
    """Directory to save checkpoints to (None: never save)."""

    save_interval: Optional[int] = None
    """Iterations between persistent checkpoint saves."""

    most_recent_k: int = -1
    """Keep only the newest k persistent checkpoints in `save` (-1: keep all)."""

    save_optim: bool = True
    """Save the optimizer state in checkpoints."""

    save_rng: bool = True
    """Save the RNG state in checkpoints."""

    load: Optional[str] = None
    """Directory to resume from (None: start from scratch)."""

    load_optim: bool = True
    """Load the optimizer state when loading a checkpoint."""

    load_main_params_from_ckpt: bool = False
    """Load fp32 main parameters from the checkpoint; for loading without optimizer state (load_optim false)."""

    load_rng: bool = True
    """Load the RNG state when loading a checkpoint."""

    non_persistent_save_interval: Optional[int] = None
    """Iterations between non-persistent checkpoint saves."""

    non_persistent_ckpt_type: Optional[str] = one_of(None, "global", "local", "in_memory")
    """Non-persistent checkpoint kind: 'global' (regular, old ones removed), 'local' (per-rank), 'in_memory'."""

    non_persistent_global_ckpt_dir: Optional[str] = None
    """Directory for global non-persistent checkpoints."""

    non_persistent_local_ckpt_dir: Optional[str] = None
    """Directory for local non-persistent checkpoints."""

    non_persistent_local_ckpt_algo: str = one_of("fully_parallel", "fully_parallel", "atomic")
    """Algorithm for local non-persistent checkpointing."""

    finetune: bool = False
    """Load only the model weights and restart at iteration 0 (assumed for release checkpoints)."""

    pretrained_checkpoint: Optional[str] = None
    """Directory of a pretrained checkpoint to start from, or a Hugging Face model folder (its config.json sets the model)."""

    export_hf_dir: Optional[str] = None
    """Write the final checkpoint as a Hugging Face folder here (new or empty) at the end of training; needs save."""

    export_hf_model_type: Optional[str] = None
    """Family to export as, to export_hf_dir and by export-hf (import-hf records the source's; None: what fits)."""

    export_hf_each_save: bool = False
    """Export every persistent save instead, to export_hf_dir/iter_XXXXXXX (training waits for each export)."""

    ckpt_step: Optional[int] = None
    """Iteration to load from `load` (None: the latest)."""

    use_checkpoint_args: bool = False
    """Override config values with those stored in the checkpoint."""

    exit_on_missing_checkpoint: bool = False
    """Exit when `load` is set but holds no checkpoint, instead of starting from random weights."""

    ckpt_format: str = one_of("torch_dist", "torch_dist", "zarr")
    """Checkpoint format."""

    ckpt_convert_format: Optional[str] = one_of(None, "torch", "torch_dist", "zarr")
    """Format to convert the loaded checkpoint to."""

    ckpt_convert_save: Optional[str] = None
    """Directory to save the converted checkpoint to."""

    fully_parallel_save: bool = True
    """Spread saving across data-parallel ranks."""

    dist_ckpt_optim_fully_reshardable: bool = False
    """Save the distributed optimizer's state per weight with global shapes (megatron-core's ``fully_reshardable``,
    Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``), so that Adam's moments load under another TP, PP or EP
    layout too; off, they load under another data-parallel size only (``dp_reshardable``) and a run under another
    layout starts its optimizer fresh. Saving gathers each data-parallel group's whole optimizer state on every
    rank of the group (12 bytes per weight of the group's share of the model): for large models see
    ``distrib_optim_fully_reshardable_mem_efficient``."""

    distrib_optim_fully_reshardable_mem_efficient: bool = False
    """With ``dist_ckpt_optim_fully_reshardable``: gather the state on the first rank of each data-parallel group only,
    over gloo (less memory, slower saves; megatron-core's flag of that name). Loads the same either way."""

    async_save: bool = False
    """Save checkpoints asynchronously (torch_dist format only)."""

    use_persistent_ckpt_worker: bool = True
    """Use one long-lived background worker for async saves instead of a new one per save."""

    fully_parallel_load: bool = False
    """Spread checkpoint loading across data-parallel ranks."""

    ckpt_assume_constant_structure: bool = False
    """Assume model and optimizer state-dict structure stays constant within a job, enabling save optimizations."""

    dist_ckpt_strictness: str = one_of(
        "assume_ok_unexpected",
        "assume_ok_unexpected",
        "log_unexpected",
        "log_all",
        "raise_unexpected",
        "raise_all",
        "return_unexpected",
        "return_all",
        "ignore_all",
    )
    """Handling of key mismatches when loading a distributed checkpoint from storage (see StrictHandling)."""

    replication: bool = False
    """Replicate local checkpoints to other ranks; must be set on all ranks."""

    replication_jump: Optional[int] = None
    """Rank spacing J between replicas of a rank's data (n+J, n+2J, ...); needs replication."""

    replication_factor: int = 2
    """Number of machines storing a replica of each rank's data."""

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for each problem; empty when the section is consistent."""
        problems = []
        if self.load_main_params_from_ckpt and self.load_optim:
            problems.append(("load_main_params_from_ckpt", "needs load_optim: false."))
        if self.async_save and self.save is None:
            problems.append(("async_save", "needs save set to a directory."))
        if self.async_save and not self.use_persistent_ckpt_worker:
            problems.append(("async_save", "needs use_persistent_ckpt_worker: true."))
        if self.export_hf_dir is not None and self.save is None:
            problems.append(("export_hf_dir", "needs save set to a directory (the export reads the final checkpoint)."))
        export = Path(self.export_hf_dir) if self.export_hf_dir is not None else None
        if export is not None and not self.export_hf_each_save and export.exists() and (
                not export.is_dir() or any(export.iterdir())):
            problems.append(("export_hf_dir", f"{self.export_hf_dir} already exists and is not an empty folder; "
                             "choose a new one (the export would refuse it after training)."))
        if self.export_hf_each_save and self.export_hf_dir is None:
            problems.append(("export_hf_each_save", "needs export_hf_dir."))
        if self.export_hf_each_save and self.async_save:
            problems.append(("export_hf_each_save", "needs async_save: false (an export reads a finished checkpoint)."))
        if self.most_recent_k == 0 or self.most_recent_k < -1:
            problems.append(("most_recent_k", f"must be -1 (keep all) or at least 1, got {self.most_recent_k}."))
        for name in ("save_interval", "non_persistent_save_interval"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append((name, f"must be at least 1 (or unset), got {getattr(self, name)}."))
        if self.non_persistent_save_interval is not None and self.non_persistent_ckpt_type != "global":
            problems.append(("non_persistent_ckpt_type", "must be 'global' when non_persistent_save_interval is set "
                             "(bridge supports global non-persistent checkpoints only)."))
        if self.ckpt_format != "torch_dist":
            problems.append(("ckpt_format", f"{self.ckpt_format!r} is not supported; megatron-core 0.16+ reads "
                             "and writes torch_dist."))
        return problems
