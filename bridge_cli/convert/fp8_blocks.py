"""FP8 block-quantized Hugging Face folders (DeepSeek-V3's release, Qwen3's ``-FP8`` ones): checked, then
dequantized one tensor at a time as import-hf reads it.

Such a folder's config.json says ``"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}``, and each quantized ``X.weight`` (stored
``float8_e4m3fn``, ``[out, in]``) comes with ``X.weight_scale_inv`` (fp32, ``[ceil(out / 128), ceil(in / 128)]``).
Block ``(i, j)`` is rows ``128 i`` to ``128 (i + 1)`` and columns ``128 j`` to ``128 (j + 1)`` of the weight, cut
short at its edges, and its value is the stored FP8 number times ``weight_scale_inv[i, j]``: the "inverse" is of
the quantization's division (``q = w / scale``), so the stored scale multiplies. That is DeepSeek's own
``weight_dequant`` and transformers' (5.x, ``integrations/finegrained_fp8.py``); the embedding, the norms, the
routers and the output head stay unquantized, without a scale. Which tensors are quantized is read per tensor,
from the dtypes in the safetensors headers, so a ``modules_to_not_convert`` list needs no reading.

Everything is checked from config.json and the headers before any tensor is read (a missing or misshapen
``weight_scale_inv`` fails in a second, naming the file and tensor). No torch import at module level.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.convert.hf_config import unsupported

KEY = "quantization_config"
SCALE_SUFFIX = "_scale_inv"
"""``X.weight`` -> its scales, ``X.weight_scale_inv``."""
FP8 = "F8_E4M3"
"""The safetensors dtype of a quantized weight (torch's float8_e4m3fn)."""
SCALE_DTYPE = "F32"
SUPPORTED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""The settings bridge dequantizes, with what each would mean otherwise in the refusal below."""
_OTHERWISE = {
    "quant_method": "another quantization scheme",
    "fmt": "another FP8 format than e4m3 (torch's float8_e4m3fn)",
    "activation_scheme": "activation scales stored with the weights (input_scale tensors)",
    "weight_block_size": "blocks of another size than the 128 x 128 that DeepSeek-V3 and Qwen3 release",
}
PASSIVE = {"modules_to_not_convert": None, "scale_fmt": ("float", "ue8m0")}
"""Keys that change nothing here: which modules stay unquantized (read from each tensor's dtype instead), and the
rounding of the scales (ue8m0: powers of two), which are stored as fp32 either way (checked per tensor)."""


@dataclass(frozen=True)
class Fp8Blocks:
    """The quantized tensors of a folder: each FP8 weight's name -> its scales' name, and the block shape."""

    scales: Mapping[str, str]
    block: tuple[int, int]

    def __contains__(self, name: str) -> bool:
        return name in self.scales

    def note(self) -> str:
        """What the import did, for its summary line and its recipe's header."""
        rows, cols = self.block
        return (f"{len(self.scales)} FP8 (e4m3) tensors dequantized from {rows}x{cols} blocks with their "
                f"weight_scale_inv (config.json's {KEY})")

    def dequantized(self, weights, name: str, tensor, dtype):
        """``tensor``, read as ``name`` from the SafetensorsFolder ``weights``: with its block scales applied, in
        ``dtype`` (the model's), if it is one of the quantized ones, else as it is."""
        if name not in self.scales:
            return tensor
        return dequantize(tensor, weights.tensor(self.scales[name]), self.block).to(dtype)


def check_config(hf: Mapping[str, Any], where: Path) -> Optional[tuple[int, int]]:
    """The block shape of config.json ``hf``'s ``quantization_config`` (None: it has none); settings other than
    DeepSeek-V3's FP8 blocks are refused, naming the key and its value."""
    config = hf.get(KEY)
    if config is None:
        return None
    if not isinstance(config, dict):
        unsupported(where, f"{KEY} is {config!r}, not an object")
    for key, value in config.items():
        if key in SUPPORTED:
            if value != SUPPORTED[key]:
                unsupported(where, f"{KEY}.{key} is {value!r}: bridge dequantizes {KEY}.{key} {SUPPORTED[key]!r} "
                                   f"only, not {_OTHERWISE[key]}",
                            "Dequantize the folder with the tool that made it, save it unquantized (bf16), and "
                            "import that.")
        elif key not in PASSIVE or (PASSIVE[key] is not None and value not in PASSIVE[key]):
            unsupported(where, f"{KEY}.{key} is {value!r}, a setting bridge does not know the meaning of",
                        f"bridge dequantizes FP8 blocks as {json.dumps(SUPPORTED)} describes.")
    if "quant_method" not in config:
        unsupported(where, f"{KEY} has no quant_method", f"bridge dequantizes {KEY} {json.dumps(SUPPORTED)}.")
    # a key left out means transformers' default (FineGrainedFP8Config: dynamic, 128 x 128); e4m3 is checked per tensor
    rows, cols = SUPPORTED["weight_block_size"]
    return rows, cols


def plan(hf: Mapping[str, Any], where: Path, weights, expected: Mapping[str, tuple[int, ...]]) -> Optional[Fp8Blocks]:
    """The quantized tensors among ``expected`` (the names and shapes the family maps) of SafetensorsFolder
    ``weights``, checked against config.json ``hf`` (read from ``where``): None for a folder without FP8 weights.

    Each FP8 weight must be a matrix with a fp32 ``weight_scale_inv`` of one value per block; a scale without its
    FP8 weight, or an FP8 tensor without config.json's quantization_config, is refused too (CheckpointError).
    """
    block = check_config(hf, where)
    fp8 = [name for name in expected if weights.dtypes[name] == FP8]
    other_f8 = [name for name in expected if weights.dtypes[name].startswith("F8_") and weights.dtypes[name] != FP8]
    if other_f8:
        name = other_f8[0]
        raise CheckpointError(f"{weights.file_of(name)}: tensor {name} is stored as {weights.dtypes[name]}; bridge "
                              "dequantizes FP8 e4m3 (F8_E4M3) weights only.")
    if fp8 and block is None:
        raise CheckpointError(f"{weights.file_of(fp8[0])}: tensor {fp8[0]} is stored in FP8 (e4m3), and "
                              f"{where} has no {KEY} saying how to dequantize it. Add DeepSeek-V3's "
                              f"(\"{KEY}\": {json.dumps(SUPPORTED)}) if its weight_scale_inv tensors are 128x128 "
                              "block scales.")
    scales = {}
    for name in fp8:
        scale = name + SCALE_SUFFIX
        shape = expected[name]
        if scale not in weights.shapes:
            raise CheckpointError(f"{weights.file_of(name)}: tensor {name} is stored in FP8 (e4m3) and its scales, "
                                  f"tensor {scale}, are missing from {weights.folder}. The download is incomplete.")
        if len(shape) != 2:
            raise CheckpointError(f"{weights.file_of(name)}: tensor {name} is stored in FP8 with shape {shape}; "
                                  "bridge dequantizes the blocks of matrices only.")
        grid = tuple(-(-size // edge) for size, edge in zip(shape, block))
        if weights.shapes[scale] != grid:
            raise CheckpointError(f"{weights.file_of(scale)}: tensor {scale} has shape {weights.shapes[scale]}; "
                                  f"the {shape[0]}x{shape[1]} FP8 weight {name} in {block[0]}x{block[1]} blocks "
                                  f"needs {grid}. The scales belong to another weight or block size.")
        if weights.dtypes[scale] != SCALE_DTYPE:
            raise CheckpointError(f"{weights.file_of(scale)}: tensor {scale} is stored as {weights.dtypes[scale]}; "
                                  "bridge reads FP8 block scales stored as fp32 (F32).")
        scales[name] = scale
    strays = [name for name in weights.shapes
              if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in expected
              and name.removesuffix(SCALE_SUFFIX) not in scales]
    if strays:
        weight = strays[0].removesuffix(SCALE_SUFFIX)
        raise CheckpointError(f"{weights.file_of(strays[0])}: tensor {strays[0]} holds block scales of {weight}, "
                              f"which is stored as {weights.dtypes[weight]}, not FP8 (e4m3); the folder mixes "
                              "quantized and unquantized files.")
    return Fp8Blocks(scales, block) if scales else None


def dequantize(weight, scale_inv, block: tuple[int, int] = (128, 128)):
    """The fp32 matrix of FP8 ``weight`` ``[out, in]``: each ``block`` of it (the last row and column of blocks
    cut short at the edges) times its value in ``scale_inv`` ``[ceil(out / rows), ceil(in / cols)]``.

    Holds the weight in fp32 once, plus its scales repeated down the rows (1/cols of it).
    """
    import torch

    rows, cols = weight.shape
    block_rows, block_cols = block
    out = weight.to(torch.float32)
    per_row = scale_inv.to(torch.float32).repeat_interleave(block_rows, dim=0)[:rows]  # [out, column blocks]
    whole, rest = divmod(cols, block_cols)
    if whole:
        out[:, : whole * block_cols].unflatten(1, (whole, block_cols)).mul_(per_row[:, :whole, None])
    if rest:
        out[:, whole * block_cols:].mul_(per_row[:, whole:])
    return out
