"""Offloaded causal LM: decoder layers streamed through a small ring of device buffers.

SpecExec (Svirschevski et al., 2024, arXiv 2406.02532) targets models that do not fit in GPU
memory. Their weights live in RAM or on an SSD and every target pass streams all of them through
the device, so a pass costs about the same for one token or a thousand: a large draft tree rides
on bandwidth that is spent anyway. This module is that target. Embeddings, final norm, LM head,
rotary embedding and KV cache stay on the device; each decoder layer is copied into one of
`buffers` device slots just before it runs, while the next layer is already on its way.

| paper / idea                 | code                                                          |
| ---------------------------- | ------------------------------------------------------------- |
| offloaded target model       | `OffloadedCausalLM`, built by `from_pretrained`               |
| where the weights live       | storage: `RamStorage` (mode="ram"), `DiskStorage` (mode="ssd") |
| what is on the device now    | `LayerRing`: `buffers` slots, filled in order by one reader   |
| layer i+1 loads while i runs | `LayerRing.prefetch` / `.wait` / `.release` in `forward`      |
| cost of one target pass      | `PassStats`: bytes moved, waiting vs computing, GB/s          |

Storage (the bytes of each layer and where they are), state (which layer occupies which device
slot) and config (the Hugging Face model: config, masks, rotary, the decoder layers' code) are
kept apart; a decoder layer's parameters point into a slot only while that layer runs.
"""

import concurrent.futures
import hashlib
import json
import os
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Self

import torch
from torch import nn
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, GenerationConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # config.model_type
# Layer buffers and the ranges read into them start on page boundaries: any dtype can view the
# bytes there, and O_DIRECT reads (whole, aligned pages) can land there.
PAGE = 4096


class OffloadError(ValueError):
    """Bad input to the offloader: a one-line message that says what and where."""


# ---- storage: where each layer's bytes live ----


class TensorSpec(NamedTuple):
    offset: int  # bytes from the start of the layer buffer
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """How one layer's tensors sit in its flat byte buffer."""

    tensors: dict[str, TensorSpec]  # name inside the layer, e.g. "self_attn.q_proj.weight"
    nbytes: int

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed, shaped views of a flat uint8 buffer; no copy."""
        out = {}
        for name, (offset, dtype, shape) in self.tensors.items():
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            out[name] = buffer[offset : offset + nbytes].view(dtype).view(shape)
        return out


def pack(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> Layout:
    """Tensors end to end at aligned offsets: the layout of one RAM buffer."""
    tensors, offset = {}, 0
    for name, shape in shapes.items():
        tensors[name] = TensorSpec(offset, dtype, shape)
        offset += round_up(torch.Size(shape).numel() * dtype.itemsize)
    return Layout(tensors, offset)


def round_up(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def page_aligned(nbytes: int, device: torch.device, pin: bool = False) -> torch.Tensor:
    """(nbytes,) uint8 starting on a page boundary, where an O_DIRECT read may land."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, device=device, pin_memory=pin)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes]


class RamStorage:
    """Each layer in ONE contiguous host buffer (pinned for CUDA): a layer moves in one copy."""

    def __init__(self, layouts: list[Layout], buffers: list[torch.Tensor]):
        self.layouts = layouts
        self.buffers = buffers  # buffers[i]: (layouts[i].nbytes,) uint8

    def host_bytes(self, layer: int, scratch: torch.Tensor) -> torch.Tensor:
        return self.buffers[layer]  # already in memory: nothing to read

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file, as the file's header describes it."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


@dataclass
class Read:
    """One pread of `path` from `file_offset` into the layer buffer at `buffer_offset`.

    `nbytes` must arrive; the read asks for whole pages (round_up(nbytes)), as O_DIRECT wants.
    """

    path: Path
    file_offset: int
    nbytes: int
    buffer_offset: int


def plan_reads(entries: dict[str, Entry]) -> tuple[Layout, list[Read]]:
    """Merge one layer's tensors into page-aligned ranges of their files: one read per range.

    Hugging Face checkpoints store tensors sorted by name, so a layer is usually one range per
    file. A range keeps the file's byte layout, so a tensor sits in the buffer where it sat in
    the file, shifted by where its range landed.
    """
    tensors, reads = {}, []
    for name, entry in sorted(entries.items(), key=lambda item: (str(item[1].path), item[1].start)):
        last = reads[-1] if reads else None
        if (
            last is None
            or last.path != entry.path
            or entry.start > last.file_offset + round_up(last.nbytes)
        ):
            end = last.buffer_offset + round_up(last.nbytes) if last else 0
            last = Read(entry.path, entry.start // PAGE * PAGE, 0, end)
            reads.append(last)
        last.nbytes = entry.end - last.file_offset
        offset = last.buffer_offset + entry.start - last.file_offset
        tensors[name] = TensorSpec(offset, entry.dtype, entry.shape)
    return Layout(tensors, reads[-1].buffer_offset + round_up(reads[-1].nbytes)), reads


class DiskStorage:
    """Layers stay in safetensors files; a layer is a few preads straight into a buffer."""

    def __init__(self, layers: list[dict[str, Entry]]):
        self.layouts, self.reads = zip(*(plan_reads(entries) for entries in layers), strict=True)
        paths = {read.path for reads in self.reads for read in reads}
        self.fds = {path: open_direct(path) for path in paths}  # closed in close()

    def host_bytes(self, layer: int, scratch: torch.Tensor) -> torch.Tensor:
        """Read a layer into `scratch`, a page-aligned host buffer."""
        for read in self.reads[layer]:
            target = scratch[read.buffer_offset : read.buffer_offset + round_up(read.nbytes)]
            pread_into(self.fds[read.path], target, read.file_offset, read.path, read.nbytes)
        return scratch[: self.layouts[layer].nbytes]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def open_direct(path: Path) -> int:
    """A file descriptor that reads with O_DIRECT where the filesystem allows it (tmpfs doesn't).

    O_DIRECT lets the disk write straight into our buffer. A buffered read costs a copy out of the
    page cache, measured here at ~0.7 CPU-seconds per GB: CPU time the layer's compute needs.
    """
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return os.open(path, os.O_RDONLY)


def pread_into(fd: int, buffer: torch.Tensor, file_offset: int, path: Path, needed=None) -> None:
    """Read into a host uint8 buffer from `file_offset` until `needed` bytes (default: all) are in.

    pread may return short, so loop; a page-rounded read may also run into the end of the file.
    """
    target, done, needed = memoryview(buffer.numpy()), 0, needed or len(buffer)
    while done < needed:
        got = os.preadv(fd, [target[done:]], file_offset + done)
        if got == 0:
            raise OffloadError(
                f"truncated safetensors shard {path}: ends before {file_offset + done}"
            )
        done += got


# ---- the ring: what is on the device right now ----


@dataclass
class Load:
    layer: int
    slot: int
    done: concurrent.futures.Future  # its result: seconds the reader spent on this load


class LayerRing:
    """`buffers` device slots, filled by one reader thread in the order the layers will run.

    Slots are handed out round-robin, so a new load always takes the slot of the layer released
    last. At most `buffers` layers are alive at once: in flight, landed, or computing.
    """

    def __init__(self, storage, buffers: int, n_layers: int, device: torch.device):
        self.storage, self.device = storage, device
        nbytes = max(layout.nbytes for layout in storage.layouts)
        self.slots = [
            page_aligned(nbytes, device)  # (slot_nbytes,)
            for _ in range(max(1, min(buffers, n_layers)))
        ]
        self.lookahead = len(self.slots) - 1  # layers loading while one computes
        # CUDA (untested here: this machine has no GPU). A read lands in pinned host staging, then
        # a side stream copies it to the device, so the copy overlaps compute on the main stream.
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        self.staging = self.slots  # on CPU a disk read lands in the slot itself
        if cuda and isinstance(storage, DiskStorage):
            self.staging = [page_aligned(nbytes, torch.device("cpu"), pin=True) for _ in self.slots]
        self.reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offload-reader")
        self.queue: deque[Load] = deque()  # in the order they will be used; not yet handed out
        self.in_use: int | None = None  # the layer handed out by wait() and not yet released
        self.next_slot = 0

    def start_pass(self) -> None:
        """Keep what the last pass prefetched for layers 0.., drop an interrupted pass's loads."""
        if self.queue and self.queue[0].layer != 0:
            self.drain()
        self.in_use = None
        for layer in range(self.lookahead):
            self.prefetch(layer)

    def prefetch(self, layer: int) -> None:
        if any(load.layer == layer for load in self.queue):
            return
        if len(self.queue) + (self.in_use is not None) >= len(self.slots):
            raise RuntimeError("offload ring is full: release a layer before prefetching another")
        slot, self.next_slot = self.next_slot, (self.next_slot + 1) % len(self.slots)
        self.queue.append(Load(layer, slot, self.reader.submit(self._load, layer, slot)))

    def _load(self, layer: int, slot: int) -> float:
        """On the reader thread: bring one layer's bytes into its slot."""
        started = time.perf_counter()
        host = self.storage.host_bytes(layer, self.staging[slot])  # (layer_nbytes,) uint8, host
        with torch.cuda.stream(self.copy_stream) if self.copy_stream else nullcontext():
            if host.data_ptr() != self.slots[slot].data_ptr():  # else: read straight into it
                self.slots[slot][: host.numel()].copy_(host, non_blocking=True)
        if self.copy_stream is not None:
            self.copy_stream.synchronize()  # done means on the device, and staging is free again
        return time.perf_counter() - started

    def wait(self, layer: int) -> tuple[torch.Tensor, float]:
        """Block until `layer` has landed; its slot, and the reader's seconds for it."""
        load = self.queue.popleft()
        assert load.layer == layer, f"the ring holds layer {load.layer} next, not {layer}"
        seconds = load.done.result()
        self.in_use = layer
        return self.slots[load.slot], seconds

    def release(self, layer: int) -> None:
        if self.device.type == "cuda":
            # kernels run asynchronously: they must finish before the reader refills this slot
            torch.cuda.current_stream(self.device).synchronize()
        self.in_use = None

    def drain(self) -> None:
        """Let loads in flight finish and forget them: the next pass starts cold."""
        concurrent.futures.wait([load.done for load in self.queue])
        self.queue.clear()

    def close(self) -> None:
        self.drain()
        self.reader.shutdown()
        self.storage.close()


# ---- the model: the Hugging Face model, its decoder layers streamed from the ring ----


@dataclass
class PassStats:
    """What the last forward pass cost (`model.stats`, replaced by every pass)."""

    bytes_moved: int = 0  # layer bytes that reached the device
    load_s: float = 0.0  # reader-thread seconds moving them, overlapping compute
    wait_s: float = 0.0  # seconds the pass sat waiting for weights
    pass_s: float = 0.0  # wall seconds of the whole pass

    @property
    def compute_s(self) -> float:  # everything that was not waiting
        return self.pass_s - self.wait_s

    @property
    def gb_per_s(self) -> float:
        return self.bytes_moved / self.pass_s / 1e9 if self.pass_s else 0.0


MASKS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}


def layer_kinds(config) -> list[str]:
    """Each layer's mask: Qwen2/3 name it per layer; Mistral slides wherever a window is set."""
    if getattr(config, "layer_types", None):
        return list(config.layer_types)
    sliding = config.model_type == "mistral" and getattr(config, "sliding_window", None)
    return ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers


def bind(layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Point a decoder layer's parameters at these tensors (slot views, or meta to unbind)."""
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        layer.get_submodule(module)._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


class OffloadedCausalLM(nn.Module):
    """Called like the Hugging Face model it wraps; its decoder layers visit the device in turn."""

    def __init__(self, hf_model: nn.Module, storage, buffers: int):
        super().__init__()
        self.hf = hf_model  # all on the device, except the decoder layers' weights
        self.layers = hf_model.model.layers
        self.layer_kinds = layer_kinds(hf_model.config)
        self.layouts = storage.layouts
        # between runs a decoder layer rests on meta tensors: shapes, no bytes
        self.unbound = [{n: p.data for n, p in layer.named_parameters()} for layer in self.layers]
        self.ring = LayerRing(storage, buffers, len(self.layers), self.device)
        self.stats = PassStats()

    config = property(lambda self: self.hf.config)
    generation_config = property(lambda self: self.hf.generation_config)
    device = property(lambda self: self.hf.lm_head.weight.device)
    dtype = property(lambda self: self.hf.lm_head.weight.dtype)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # (batch, q)
        attention_mask: torch.Tensor | None = None,  # (batch, 1, q, n_cached + q) additive, or 2D
        position_ids: torch.Tensor | None = None,  # (batch, q)
        past_key_values: DynamicCache | None = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        started, stats, body = time.perf_counter(), PassStats(), self.hf.model
        hidden = body.embed_tokens(input_ids.to(self.device))  # (batch, q, hidden)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            n_cached = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(hidden.shape[1], device=self.device)[None] + n_cached
        # the masks the Hugging Face model would build; a caller's 4D float mask passes as it is
        mask_args = {
            "config": self.config,
            "inputs_embeds": hidden,
            "attention_mask": attention_mask,
            "past_key_values": past_key_values,
            "position_ids": position_ids,
        }
        masks = {kind: MASKS[kind](**mask_args) for kind in set(self.layer_kinds)}
        # cos and sin, each (batch, q, head_dim), shared by all layers
        position_embeddings = body.rotary_emb(hidden, position_ids)

        self.ring.start_pass()
        for i, layer in enumerate(self.layers):
            # prefetch next: layer i + lookahead takes the slot layer i - 1 released. Near the end
            # this wraps around: the next pass's first layers load during this pass's LM head.
            self.ring.prefetch((i + self.ring.lookahead) % len(self.layers))

            # wait for this one: block until its bytes have landed, then point its parameters there
            waiting = time.perf_counter()
            slot, load_s = self.ring.wait(i)
            stats.wait_s += time.perf_counter() - waiting
            stats.load_s += load_s
            stats.bytes_moved += self.layouts[i].nbytes
            bind(layer, self.layouts[i].views(slot))

            # compute: the Hugging Face decoder layer as it is (attention, cache update, MLP)
            hidden = layer(
                hidden,
                attention_mask=masks[self.layer_kinds[i]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                **kwargs,
            )  # (batch, q, hidden)

            # release: back to meta, so only the ring holds weights and the slot may be refilled
            bind(layer, self.unbound[i])
            self.ring.release(i)

        hidden = body.norm(hidden[:, -logits_to_keep:])  # logits_to_keep=0 keeps every position
        logits = self.hf.lm_head(hidden)  # (batch, q, vocab)
        stats.pass_s = time.perf_counter() - started
        self.stats = stats
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)

    def close(self) -> None:
        self.ring.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- loading: from a model folder to storage, ring and model ----


def from_pretrained(
    name_or_path: str | os.PathLike,
    *,
    mode: str = "ram",
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    offload_dir: str | os.PathLike | None = None,
    buffers: int = 2,
) -> OffloadedCausalLM:
    """An offloaded causal LM from a model folder or hub id of the Llama family.

    mode "ram": every layer in one host buffer; "ssd": layers read from safetensors every pass
    (the checkpoint's own files when their dtype fits, else a per-layer copy made in offload_dir).
    device None: cuda if available, else cpu. dtype None: the dtype stored in the checkpoint.
    """
    if mode not in ("ram", "ssd"):
        raise OffloadError(f"mode must be 'ram' or 'ssd', not {mode!r}")
    if buffers < 1:
        raise OffloadError(f"buffers must be at least 1, not {buffers}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    folder = find_folder(str(name_or_path))
    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in SUPPORTED_FAMILIES:
        raise OffloadError(
            f"model family {config.model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_FAMILIES)} (Llama, Mistral, Qwen2/3, SmolLM, TinyLlama)"
        )
    ckpt = Checkpoint(folder)
    dtype = dtype or ckpt.spec("model.layers.0.self_attn.q_proj.weight")[0]
    check_dtype_runs(device, dtype)

    # the skeleton on meta costs nothing; only the parts that stay on the device get real tensors
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    shapes = {name: tuple(p.shape) for name, p in hf.model.layers[0].named_parameters()}
    for i in range(config.num_hidden_layers):  # everything there, right shapes, before big reads
        for name, shape in shapes.items():
            ckpt.check(f"model.layers.{i}.{name}", shape)
    resident = {
        name: ckpt.tensor(name, p.shape).to(device=device, dtype=dtype)
        for name, p in hf.named_parameters()
        if not name.startswith("model.layers.")
    }
    hf.load_state_dict(resident, strict=False, assign=True)
    if getattr(hf.config, "tie_word_embeddings", False):
        hf.lm_head.weight = hf.model.embed_tokens.weight
    # rotary frequencies are computed, not stored: build them again, off the meta device
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config).to(device)
    if (folder / "generation_config.json").is_file():  # eos ids etc., as from_pretrained has them
        hf.generation_config = GenerationConfig.from_pretrained(folder)
    hf.requires_grad_(False).eval()

    if mode == "ram":
        storage = load_ram(ckpt, shapes, config.num_hidden_layers, dtype, device)
    else:
        storage = open_disk(ckpt, shapes, config.num_hidden_layers, dtype, offload_dir)
    return OffloadedCausalLM(hf, storage, buffers)


def find_folder(name_or_path: str) -> Path:
    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    from huggingface_hub import snapshot_download

    try:  # safetensors where the repo has them, .bin only where it has not
        folder = Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"]))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.bin"]))
    except (OSError, ValueError) as err:  # what the hub raises is one or the other
        raise OffloadError(f"{name_or_path} is no folder and no reachable hub id: {err}") from None
    return folder


def check_dtype_runs(device: torch.device, dtype: torch.dtype) -> None:
    """Fail now, not mid-generation, if the device cannot run a matmul and softmax in `dtype`."""
    old_gpu = device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False)
    if dtype == torch.bfloat16 and old_gpu:  # emulated bfloat16 runs, slowly
        raise OffloadError(f"{device} has no native bfloat16; pass dtype=torch.float16")
    try:
        x = torch.ones(2, 8, dtype=dtype, device=device)  # (2, 8)
        torch.softmax(x @ x.T, dim=-1)
    except (RuntimeError, NotImplementedError, TypeError) as err:
        reason = str(err).splitlines()[0]
        raise OffloadError(f"{device} cannot run {dtype} ({reason}); pass another dtype") from None


def load_ram(ckpt: "Checkpoint", shapes: dict, n_layers: int, dtype, device) -> RamStorage:
    layout = pack(shapes, dtype)  # the same for every layer
    pinned = device.type == "cuda"  # page-locked: the GPU copies it without a bounce buffer
    buffers = []
    for i in tqdm(range(n_layers), desc="offload: loading layers into RAM"):
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pinned)  # (nbytes,)
        for name, view in layout.views(buffer).items():
            view.copy_(ckpt.tensor(f"model.layers.{i}.{name}", view.shape))  # converts the dtype
        buffers.append(buffer)
    return RamStorage([layout] * n_layers, buffers)


def open_disk(ckpt: "Checkpoint", shapes: dict, n_layers: int, dtype, offload_dir) -> DiskStorage:
    layers = [
        {n: ckpt.entries.get(f"model.layers.{i}.{n}") for n in shapes} for i in range(n_layers)
    ]
    entries = [entry for layer in layers for entry in layer.values()]
    # the checkpoint's own files will do if their tensors have the dtype and can be viewed in place
    if all(e and e.dtype == dtype and e.start % dtype.itemsize == 0 for e in entries):
        return DiskStorage(layers)
    folder = convert(ckpt, shapes, n_layers, dtype, offload_dir)
    return DiskStorage(
        [read_header(folder / f"layer_{i:03d}.safetensors") for i in range(n_layers)]
    )


# ---- checkpoint files: safetensors headers, .bin shards, the per-layer offload folder ----

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_header(path: Path) -> dict[str, Entry]:
    """Parse a safetensors header (8-byte little-endian length + JSON); check the file is whole."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if size < 8 or 8 + length > size:
            raise OffloadError(f"truncated safetensors shard {path}: header runs past the end")
        try:
            header = json.loads(file.read(length))
        except ValueError:
            raise OffloadError(f"corrupt safetensors shard {path}: header is not JSON") from None
    header.pop("__metadata__", None)
    entries = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise OffloadError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = (8 + length + offset for offset in info["data_offsets"])
        entries[name] = Entry(path, DTYPES[info["dtype"]], tuple(info["shape"]), start, end)
    needed = max((entry.end for entry in entries.values()), default=0)
    if needed > size:
        raise OffloadError(
            f"truncated safetensors shard {path}: {size} bytes, header says {needed}"
        )
    return entries


class Checkpoint:
    """The tensors of a model folder: safetensors shards (read by byte range) or .bin shards."""

    def __init__(self, folder: Path):
        self.folder, self.shards = folder, []
        self.entries: dict[str, Entry] = {}  # safetensors: where each tensor's bytes are
        self.mapped: dict[str, torch.Tensor] = {}  # .bin: tensors memory-mapped by torch.load
        for weights in ("model.safetensors", "pytorch_model.bin"):
            index = folder / f"{weights}.index.json"
            if index.exists():
                files = json.loads(index.read_text())["weight_map"].values()
                self.shards = sorted({folder / file for file in files})
            elif (folder / weights).exists():
                self.shards = [folder / weights]
            for shard in self.shards:
                if not shard.is_file():
                    raise OffloadError(f"missing checkpoint shard {shard}")
                if shard.suffix == ".safetensors":
                    self.entries.update(read_header(shard))
                    continue
                try:  # mmap: bytes are paged in as tensors are touched, never the whole shard
                    self.mapped.update(torch.load(shard, mmap=True, weights_only=True))
                except RuntimeError as err:
                    reason = str(err).splitlines()[0]
                    raise OffloadError(f"corrupt checkpoint shard {shard}: {reason}") from None
            if self.shards:
                return
        raise OffloadError(f"no model.safetensors or pytorch_model.bin weights in {folder}")

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """Stored dtype and shape of one tensor."""
        if name in self.entries:
            return self.entries[name].dtype, self.entries[name].shape
        if name in self.mapped:
            return self.mapped[name].dtype, tuple(self.mapped[name].shape)
        raise OffloadError(f"{self.folder}: the checkpoint has no tensor {name}")

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        if (found := self.spec(name)[1]) != tuple(shape):
            raise OffloadError(f"{self.folder}: {name} has shape {found}, config wants {shape}")

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """One tensor on the host, in its stored dtype."""
        self.check(name, tuple(shape))
        if name in self.mapped:
            return self.mapped[name]
        entry = self.entries[name]
        found = torch.empty(entry.end - entry.start, dtype=torch.uint8)  # (nbytes,)
        with open(entry.path, "rb") as file:
            pread_into(file.fileno(), found, entry.start, entry.path)
        return found.view(entry.dtype).view(entry.shape)

    def fingerprint(self) -> str:
        """Changes when the checkpoint's files do: an older offload folder is then not reused."""
        stamps = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in self.shards]
        return hashlib.sha1(repr((str(self.folder.resolve()), stamps)).encode()).hexdigest()[:12]


def convert(ckpt: Checkpoint, shapes: dict, n_layers: int, dtype, offload_dir) -> Path:
    """Write one safetensors file per layer, in `dtype`, once; later runs reuse the folder.

    Every file is written under a temporary name, then renamed, and the manifest goes last: a
    folder left by a failed run (disk full, killed) is never taken for a finished one.
    """
    from safetensors.torch import save

    if offload_dir is None:
        raise OffloadError(f"{ckpt.folder} needs a one-time conversion for ssd; pass offload_dir")
    dtype_name = str(dtype).removeprefix("torch.")
    folder = Path(offload_dir) / f"{ckpt.folder.name}-{ckpt.fingerprint()}-{dtype_name}"
    manifest = {"source": str(ckpt.folder.resolve()), "dtype": dtype_name, "layers": n_layers}
    done = folder / "manifest.json"
    if done.is_file() and json.loads(done.read_text()) == manifest:
        return folder  # converted by an earlier run
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for i in tqdm(range(n_layers), desc=f"offload: converting layers into {folder}"):
            tensors = {
                name: ckpt.tensor(f"model.layers.{i}.{name}", shape).to(dtype).contiguous()
                for name, shape in shapes.items()
            }
            write_then_rename(folder / f"layer_{i:03d}.safetensors", save(tensors))
        write_then_rename(done, json.dumps(manifest).encode())
    except OSError as err:
        raise OffloadError(f"cannot write offload folder {folder}: {err.strerror or err}") from None
    return folder


def write_then_rename(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())  # the rename must not reach the disk before the bytes do
        os.replace(temporary, path)  # atomic: the file is either absent or whole
    finally:
        temporary.unlink(missing_ok=True)
