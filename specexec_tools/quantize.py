"""Weight-only quantization for offload.py: int8 per output channel, int4 in groups of 64 inputs.

When a target streams from RAM or disk, the bytes of its decoder layers set the price of a pass.
Stored in 8 or 4 bits, the linear layers' weights move about 2x or 3.8x fewer bytes than in
float16; the device turns them back into compute-dtype weights as they land, and the Hugging Face
layer runs on those unchanged. The model computed is therefore exactly the model whose weights are
`dequantize(*quantize(w))`: the tests hold the offloaded model against that one, and
docs/results.md ("Quantized layers") measures what it costs against the full model.

| kind | level q (one per weight)                            | scale (w ~ q * scale)          |
| ---- | --------------------------------------------------- | ------------------------------ |
| int8 | int8 in [-127, 127]                                 | absmax / 127 of each output row |
| int4 | [-7, 7], kept as q + 8 in a nibble, two per byte     | absmax / 7 of each group of     |
|      | (input 2j in the low nibble, 2j + 1 in the high one) | GROUP = 64 inputs of a row      |

Rounding to the nearest level keeps every weight within scale / 2 of its dequantized value.
Symmetric, with no zero point: dequantizing is one multiply, at the price of int4's level -8
going unused. Groups of 64 rather than 128: a group's scale follows its own largest weight, so
smaller groups lose less to one outlier, and the rows here are short (256 inputs in the default
target); a float16 scale per 64 weights costs 0.25 bit each, 4.25 bits a weight in all.
Scales are stored in the compute dtype, so the dequantized weight is q * scale rounded once.

Pure arithmetic, importing nothing of the project but the kinds' names (KINDS, held in
specexec_tools/__init__.py: the command line reads them before torch loads): a weight that cannot
be quantized is a ValueError, which checkpoint.Checkpoint.check_layers turns into its one-line
error.
offload.py's `Dequantizing` storage runs `dequantize_layer` as each layer lands, and the
self-draft (`--draft int8|int4`, offload.self_draft) is the target's own quantized copy.
"""

import functools

import torch

from specexec_tools import KINDS  # noqa: F401  (int8, int4: offload.py reads them here)

QMAX = {"int8": 127, "int4": 7}  # largest level; levels are symmetric around 0
GROUP = 64  # int4: inputs of a row that share one scale
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINEARS += ("qkv_proj", "gate_up_proj")  # Phi-3's fused projections


def is_weight(name: str) -> bool:
    """A linear layer's weight ("mlp.up_proj.weight"), or a mixture's experts stacked as
    transformers 5 holds them ("mlp.experts.down_proj": experts x out x in, each expert's rows
    quantized as a linear's): quantized. Norms, biases and the router are not."""
    module, _, leaf = name.rpartition(".")
    return module.rpartition(".")[2] in LINEARS if leaf == "weight" else leaf in LINEARS


# ---- quantize: float weights to levels and scales ----


def quantize(weight: torch.Tensor, kind: str, dtype: torch.dtype):
    """(out, in) weight -> levels (int8 (out, in) | uint8 (out, in // 2)) and scales in `dtype`
    (int8: (out,); int4: (out, in // GROUP)). Works on meta tensors too: the stored layout.
    Stacked experts (experts, out, in) are quantized as (experts * out, in)."""
    weight = weight.flatten(0, -2)  # (out, in)
    rows, cols = weight.shape
    if kind == "int4" and cols % GROUP:
        raise ValueError(f"int4 quantizes groups of {GROUP} inputs; a weight has {cols} inputs")
    groups = cols // GROUP if kind == "int4" else 1
    work = torch.promote_types(dtype, torch.float32)  # float16 weights are divided in float32
    w = weight.to(work).view(rows, groups, cols // groups)  # (out, groups, group size)
    scale = (w.abs().amax(-1, keepdim=True) / QMAX[kind]).to(dtype)  # (out, groups, 1)
    scale = scale.clamp_min(torch.finfo(dtype).tiny)  # an all-zero group: levels 0, not NaN
    # levels from the scale as stored, so that the bound holds for the weights dequantized
    levels = (w / scale.to(work)).round().clamp(-QMAX[kind], QMAX[kind]).flatten(1)  # (out, in)
    if kind == "int8":
        return levels.to(torch.int8), scale.flatten()
    nibbles = (levels + 8).to(torch.uint8)  # (out, in), 0..15: input 2j low, 2j + 1 high
    return nibbles[:, 0::2] | nibbles[:, 1::2] << 4, scale.squeeze(-1)  # (out, in // 2)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(out, in // 2) -> (out, in) uint8 values 0..15, in input order (dequantize writes them
    straight into its output instead)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(1)


# ---- dequantize: levels and scales back to compute-dtype weights ----


def dequantize(levels: torch.Tensor, scale: torch.Tensor, kind: str, out=None) -> torch.Tensor:
    """quantize's output -> the (out, in) weight in the scale's dtype, written into `out` if given.

    In place: int4's nibbles, taken apart as bytes (torch has no bitwise kernel that writes
    floats on CUDA), are cast as they are written into `out`; then - 8 and * scale pass over it,
    eager torch having no one kernel for (q - 8) * scale.
    One CPU core does roughly 0.5-1 billion weights a second: slower than the float16 bytes it
    saves arrive there (docs/results.md, "Quantized layers").
    """
    rows = levels.shape[0]
    cols = levels.shape[1] * (2 if kind == "int4" else 1)
    if out is None:
        out = torch.empty(rows, cols, dtype=scale.dtype, device=scale.device)  # (out, in)
    grouped = out.view(rows, scale.numel() // rows, -1)  # (out, groups, group size)
    if kind == "int8":
        out.view(rows, cols).copy_(levels)  # integers to floats: exact; out may be stacked
    else:  # low nibbles straight into the even inputs, high into the odd: nothing unpacked
        pairs = out.view(rows, cols // 2, 2)  # (out, in // 2, 2)
        pairs[..., 0] = levels & 15  # (out, in // 2) bytes, then floats
        pairs[..., 1] = levels >> 4
        grouped.sub_(8)  # the nibbles hold q + 8
    grouped.mul_(scale.view(rows, -1, 1))  # the one rounding
    return out


# ---- a decoder layer: what it stores, and back ----


def quantize_layer(tensors: dict, dtype: torch.dtype, kind: str | None) -> dict:
    """A layer's tensors as storage keeps them: each linear weight as `name.q` and `name.scale`,
    the rest (and everything when kind is None) in `dtype`. Meta tensors give the layout."""
    stored = {}
    for name, tensor in tensors.items():
        if kind is None or not is_weight(name):
            stored[name] = tensor.to(dtype).contiguous()
            continue
        try:
            stored[f"{name}.q"], stored[f"{name}.scale"] = quantize(tensor, kind, dtype)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    return stored


def stored_layer(shapes: dict, dtype: torch.dtype, kind: str | None) -> dict:
    """quantize_layer of a layer with these shapes, on meta: dtypes and shapes, no bytes."""
    return dict(stored_layout(tuple(shapes.items()), dtype, kind))


# once per layer shape: on meta, quantize runs torch's reference kernels, written in Python (some
# 50 ms a layer), and each load sizes a layer several times (the check, the slots, the storage)
@functools.lru_cache(maxsize=None)
def stored_layout(shapes: tuple, dtype: torch.dtype, kind: str | None) -> dict:
    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes}
    return quantize_layer(meta, dtype, kind)


def dequantize_layer(stored: dict, weights: dict, kind: str) -> None:
    """Into each compute-dtype weight, from its stored levels and scale (views of one slot)."""
    for name, weight in weights.items():
        dequantize(stored[f"{name}.q"], stored[f"{name}.scale"], kind, out=weight)
