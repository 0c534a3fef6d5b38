"""Offloaded causal LM: decoder layers streamed through a small ring of device buffers.

SpecExec (Svirschevski et al., 2024, arXiv 2406.02532) targets models that do not fit in GPU
memory. Their weights live in RAM or on an SSD and every target pass streams all of them through
the device, so a pass costs about the same for one token or a thousand: a large draft tree rides
on bandwidth that is spent anyway. This module is that target. Embeddings, final norm, LM head,
rotary embedding and KV cache stay on the device; each decoder layer is copied into one of
`buffers` device slots just before it runs, while the next layer is already on its way. Given
`device_memory`, as many layers as fit beside those stay on the device for good, and a pass moves
only the others' bytes (UMbreLLa's resident layers).

| paper / idea                 | code                                                          |
| ---------------------------- | ------------------------------------------------------------- |
| offloaded target model       | `OffloadedCausalLM`, built by `from_pretrained`               |
| where the weights live       | storage: `RamStorage` (mode="ram"), `DiskStorage` (mode="ssd") |
| what is on the device now    | `LayerRing`: `buffers` slots, filled in order by one reader   |
| layers kept on the device    | `device_memory=`: `LayerRing.kept`, loaded once, never moved  |
| layer i+1 loads while i runs | `StreamedLayers.__iter__`: prefetch, wait, compute, release   |
| the device's few operations  | `Cuda` (streams, events) and `Cpu`; tests add a fake one      |
| cost of one target pass      | `PassStats`: bytes moved, waiting vs computing, GB/s          |
| int8 / int4 weights          | `Dequantizing` around either storage; arithmetic: quantize.py |

Storage (the bytes of each layer and where they are), state (which layer occupies which device
slot) and config (the Hugging Face model: config, masks, rotary, the decoder layers' code) are
kept apart. The Hugging Face model runs its own forward; only its list of decoder layers is
replaced by `StreamedLayers`, whose iteration brings each layer in and takes it out again.

Ordering on CUDA, without a host synchronize per layer: a load records a "ready" event on the
copy stream, and compute waits on it on the device; a release records a "freed" event on the
compute stream, and the next copy into that slot waits on it. The host blocks only before it
refills a staging chunk whose copy may still be running, and once at the end of a pass.
"""

import concurrent.futures
import copy
import math
import os
import time
from collections import deque, namedtuple
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple, Self

import torch
from torch import nn
from tqdm import tqdm

from specexec_tools import checkpoint as files
from specexec_tools import models
from specexec_tools import quantize as quant
from specexec_tools.checkpoint import OffloadError

# Layer buffers and the ranges read into them start on page boundaries: any dtype can view the
# bytes there, and O_DIRECT reads (whole, aligned pages) can land there.
PAGE = 4096


# ---- the device: six operations, on CUDA streams or in order on the CPU ----


def page_aligned(nbytes: int, device: torch.device) -> torch.Tensor:
    """(nbytes,) uint8 starting on a page boundary, where an O_DIRECT read may land."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, device=device)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes]


class Cpu:
    """Each "stream" is the thread that issues its work (copy: the reader; compute: the caller),
    and a thread runs its work in order: an event is done once it is recorded, waits are free."""

    staging = None  # slots are host memory: a disk read lands in one directly, not via staging
    device, pinned_bytes = torch.device("cpu"), 0
    # record(stream), wait_event(stream, event), host_wait(event), close(): nothing to do
    record = wait_event = host_wait = close = lambda self, *args: None

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return page_aligned(nbytes, torch.device("cpu"))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def launch(self, fn, *args, **kwargs):  # compute: here, now
        return fn(*args, **kwargs)

    convert = launch  # device work on the copy stream, after its copies: here, now


class Cuda(Cpu):
    """A copy stream beside the compute (current) stream, ordered by events, never the host.

    Host memory is page-aligned and registered with cudaHostRegister, pinned byte for byte:
    `pin_memory=True` would round each block up to a power of two (16 GiB for a 12 GiB model).
    Written to be right by construction; this module's tests run its ordering on a fake device.
    """

    staging = (4, 32 * 2**20)  # pinned chunks a disk read passes through: count, bytes each

    def __init__(self, device: torch.device):
        self.device, self.registered, self.pinned_bytes = device, [], 0
        self.copy_stream = torch.cuda.Stream(device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = page_aligned(nbytes, torch.device("cpu"))  # (nbytes,)
        if int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)) != 0:
            raise OffloadError(f"cannot pin {nbytes / 1e9:.2f} GB of host memory for {self.device}")
        self.registered.append(buffer)
        self.pinned_bytes += nbytes
        return buffer

    def stream(self, name: str) -> torch.cuda.Stream:
        return self.copy_stream if name == "copy" else torch.cuda.current_stream(self.device)

    def record(self, stream: str) -> torch.cuda.Event:
        event = torch.cuda.Event()  # a new one per record: nothing can wait on it unrecorded
        event.record(self.stream(stream))
        return event

    def wait_event(self, stream: str, event: torch.cuda.Event) -> None:
        self.stream(stream).wait_event(event)  # on the device; the host goes on

    def host_wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)

    def convert(self, fn, *args) -> None:
        with torch.cuda.stream(self.copy_stream):
            fn(*args)

    def close(self) -> None:
        self.copy_stream.synchronize()  # no copy may still read what is unregistered here
        for buffer in self.registered:
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
        self.registered, self.pinned_bytes = [], 0


# ---- storage: where each layer's bytes live, and how they reach a slot ----


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


def pack(tensors: dict[str, torch.Tensor]) -> Layout:
    """Tensors (meta ones will do) end to end at aligned offsets: the layout of one RAM buffer."""
    specs, offset = {}, 0
    for name, tensor in tensors.items():
        specs[name] = TensorSpec(offset, tensor.dtype, tuple(tensor.shape))
        offset += round_up(tensor.nbytes)
    return Layout(specs, offset)


def round_up(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


class Storage:
    """Where layers' bytes live. `layouts[i]`: what a load of layer i moves into a slot."""

    layouts: list[Layout]

    def slot_nbytes(self) -> int:
        return max(layout.nbytes for layout in self.layouts)

    def views(self, layer: int, slot: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the decoder layer binds once `slot` holds it: its parameters."""
        return self.layouts[layer].views(slot)

    def close(self) -> None:
        pass


class RamStorage(Storage):
    """All layers in ONE host arena (pinned on CUDA), one region per layer: one copy moves it."""

    def __init__(self, layout: Layout, n_layers: int, ops):
        self.layouts = [layout] * n_layers  # every layer's; whole pages
        arena = ops.host_buffer(n_layers * layout.nbytes)  # pinned on CUDA: copied without a bounce
        self.buffers = [arena[i * layout.nbytes :][: layout.nbytes] for i in range(n_layers)]

    def fill(self, ckpt: "files.Checkpoint", shapes: dict, dtype, kind) -> None:
        """Every layer into the arena, quantized as `kind` says: the big read, done once."""
        for i in tqdm(range(len(self.layouts)), desc="offload: loading layers into RAM"):
            views = self.layouts[i].views(self.buffers[i])
            for name, tensor in quant.quantize_layer(ckpt.layer(i, shapes), dtype, kind).items():
                views[name].copy_(tensor)

    def load(self, layer: int, slot: torch.Tensor, ops) -> None:
        ops.copy(slot[: self.layouts[layer].nbytes], self.buffers[layer])


@dataclass
class Read:
    """One pread of `path` from `file_offset` into the layer buffer at `buffer_offset`.

    `nbytes` must arrive; the read asks for whole pages (round_up(nbytes)), as O_DIRECT wants.
    """

    path: Path
    file_offset: int
    nbytes: int
    buffer_offset: int


def plan_reads(entries: dict[str, files.Entry]) -> tuple[Layout, list[Read]]:
    """Merge one layer's tensors into page-aligned ranges of their files: one read per range.

    Hugging Face checkpoints store tensors sorted by name, so a layer is usually one range per
    file. A range keeps the file's byte layout, so a tensor sits in the buffer where it sat in
    the file, shifted by where its range landed.
    """
    tensors, reads = {}, []
    for name, entry in sorted(entries.items(), key=lambda item: (str(item[1].path), item[1].start)):
        last = reads[-1] if reads else None
        covered = last.file_offset + round_up(last.nbytes) if last else 0  # the range's file end
        if not (last and last.path == entry.path and entry.start <= covered):  # a new range
            end = last.buffer_offset + round_up(last.nbytes) if last else 0  # its buffer end
            last = Read(entry.path, entry.start // PAGE * PAGE, 0, end)
            reads.append(last)
        last.nbytes = entry.end - last.file_offset
        offset = last.buffer_offset + entry.start - last.file_offset
        tensors[name] = TensorSpec(offset, entry.dtype, entry.shape)
    return Layout(tensors, reads[-1].buffer_offset + round_up(reads[-1].nbytes)), reads


class DiskStorage(Storage):
    """Layers stay in safetensors files; a layer is a few preads, through staging or direct.

    Where the device cannot read host memory, reads land in a few pinned staging chunks: while
    chunk k copies to the device the next one is read, so disk and copy engine overlap; chunk k
    is read into again only after its last copy finished, the one wait that blocks the host.
    """

    def __init__(self, layers: list[dict[str, files.Entry]], ops):
        self.layouts, self.reads = zip(*(plan_reads(entries) for entries in layers), strict=True)
        paths = {read.path for reads in self.reads for read in reads}
        self.fds = {path: files.open_direct(path) for path in paths}  # closed in close()
        count, self.chunk_nbytes = ops.staging or (0, 0)
        self.chunks = [ops.host_buffer(self.chunk_nbytes) for _ in range(count)]  # (chunk,) each
        self.copied = [None] * count  # each chunk's last copy, as an event on the copy stream
        self.next = 0  # the chunk the next read lands in

    def load(self, layer: int, slot: torch.Tensor, ops) -> None:
        """Read a layer into `slot` (page-aligned): straight in, or chunk by chunk via staging."""
        for read in self.reads[layer]:
            fd, rounded = self.fds[read.path], round_up(read.nbytes)
            if not self.chunks:  # the slot is host memory: the disk writes straight into it
                target = slot[read.buffer_offset : read.buffer_offset + rounded]
                files.pread_into(fd, target, read.file_offset, read.path, read.nbytes)
                continue
            for start in range(0, read.nbytes, self.chunk_nbytes):
                size = min(self.chunk_nbytes, rounded - start)  # whole pages
                k, self.next = self.next, (self.next + 1) % len(self.chunks)
                if self.copied[k] is not None:  # its last copy may still be reading it
                    ops.host_wait(self.copied[k])
                chunk, offset = self.chunks[k][:size], read.file_offset + start
                files.pread_into(fd, chunk, offset, read.path, min(size, read.nbytes - start))
                target = slot[read.buffer_offset + start :][:size]
                ops.copy(target, chunk)  # on the copy stream, while the next chunk is read
                self.copied[k] = ops.record("copy")

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


class Dequantizing(Storage):
    """Quantized layers (quantize.py), kept by the ram or ssd storage it wraps.

    A slot holds the bytes that moved (`layouts`, what PassStats counts), then, from `start`, the
    compute-dtype weights they are dequantized into on the copy stream: the layer's "ready" event
    covers both, so compute waits for nothing new. Norms and biases move as they are.
    """

    def __init__(self, storage: Storage, shapes: dict, dtype: torch.dtype, kind: str):
        self.storage, self.layouts, self.kind = storage, storage.layouts, kind
        self.start = storage.slot_nbytes()  # a whole number of pages
        weights = quant.stored_layer(shapes, dtype, None)  # meta tensors in the compute dtype
        self.weights = pack({n: w for n, w in weights.items() if quant.is_weight(n)})

    def slot_nbytes(self) -> int:
        return self.start + self.weights.nbytes

    def load(self, layer: int, slot: torch.Tensor, ops) -> None:
        self.storage.load(layer, slot, ops)
        weights = self.weights.views(slot[self.start :])
        ops.convert(quant.dequantize_layer, self.layouts[layer].views(slot), weights, self.kind)

    def views(self, layer: int, slot: torch.Tensor) -> dict[str, torch.Tensor]:
        """The decoder layer's parameters: norms and biases as moved, weights dequantized."""
        moved = super().views(layer, slot)
        kept = {name: t for name, t in moved.items() if not name.endswith((".q", ".scale"))}
        return kept | self.weights.views(slot[self.start :])

    def close(self) -> None:
        self.storage.close()


# ---- the ring: what is on the device right now ----


# A layer on its way: its slot, and a future whose result is (ready event, reader seconds), set
# once the reader has issued all of the load's work.
Load = namedtuple("Load", "layer slot issued")


class LayerRing:
    """`buffers` device slots, filled by one reader thread in the order the layers will run; and
    the resident layers, each loaded once into a buffer of its own and never moved again.

    Slots are handed out round-robin, so a new load always takes the slot of the layer released
    last. At most `buffers` streamed layers are alive at once: in flight, landed, or computing.
    """

    def __init__(self, storage, buffers: int, n_layers: int, n_resident: int, ops):
        self.storage, self.ops = storage, ops
        nbytes = storage.slot_nbytes()
        # resident layers spread evenly through the pass: while one computes, the next streamed
        # layer keeps loading, where a block of them would leave the stream idle that long
        resident = [(j + 1) * n_layers // n_resident - 1 for j in range(n_resident)]
        self.kept = {i: page_aligned(nbytes, ops.device) for i in resident}  # (nbytes,) each
        self.order = [i for i in range(n_layers) if i not in self.kept]  # the streamed layers
        self.slots = [page_aligned(nbytes, ops.device) for _ in self.order[:buffers]]  # (nbytes,)
        self.freed = [None] * len(self.slots)  # each slot's last release, an event on compute
        self.lookahead = max(0, len(self.slots) - 1)  # layers loading while one computes
        # what to prefetch as each streamed layer starts: the streamed layer `lookahead` further on,
        # past the pass's end into the next pass's first ones
        self.after = dict(
            zip(self.order, self.order[self.lookahead :] + self.order[: self.lookahead])
        )
        self.reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offload-reader")
        self.queue: deque[Load] = deque()  # in the order they will be used; not yet handed out
        self.in_use: Load | None = None  # handed out by wait() and not yet released
        self.next_slot = 0

    def start_pass(self) -> None:
        """Keep what the last pass prefetched for its first layers, drop an interrupted pass's."""
        if self.queue and self.queue[0].layer != self.order[0]:
            self.drain()
        for layer in self.order[: self.lookahead]:
            self.prefetch(layer)

    def prefetch(self, layer: int) -> None:
        if any(load.layer == layer for load in self.queue):
            return
        assert len(self.queue) + (self.in_use is not None) < len(self.slots), "the ring is full"
        slot, self.next_slot = self.next_slot, (self.next_slot + 1) % len(self.slots)
        issued = self.reader.submit(self._load, layer, slot, self.freed[slot])
        self.queue.append(Load(layer, slot, issued))

    def _load(self, layer: int, slot: int, freed) -> tuple[object, float]:
        """On the reader thread, which issues the copy stream's work: one layer into its slot."""
        started = time.perf_counter()
        if freed is not None:  # the slot's last occupant has run: only then overwrite it
            self.ops.wait_event("copy", freed)
        self.storage.load(layer, self.slots[slot], self.ops)
        return self.ops.record("copy"), time.perf_counter() - started

    def wait(self, layer: int) -> tuple[torch.Tensor, float]:
        """Compute waits (on the device) until `layer` has landed; its slot, the reader's seconds.

        The host first waits for the reader to have issued the load: an event is waited on only
        once it has been recorded.
        """
        load = self.queue.popleft()
        assert load.layer == layer, f"the ring holds layer {load.layer} next, not {layer}"
        ready, seconds = load.issued.result()
        self.ops.wait_event("compute", ready)
        self.in_use = load
        return self.slots[load.slot], seconds

    def release(self) -> None:
        """The slot may be refilled once the compute queued so far has run (an exception too)."""
        if self.in_use is not None:
            self.freed[self.in_use.slot] = self.ops.record("compute")
            self.in_use = None

    def drain(self) -> None:
        """Let loads in flight finish and forget them: the next pass starts cold."""
        concurrent.futures.wait([load.issued for load in self.queue])
        self.queue.clear()

    def close(self) -> None:
        self.drain()
        self.reader.shutdown()
        self.storage.close()
        self.ops.close()


# ---- the model: the Hugging Face model, its decoder layers streamed from the ring ----


@dataclass
class PassStats:
    """What the last forward pass cost (`model.stats`, replaced by every pass)."""

    resident_layers: int = 0  # decoder layers on the device for good: never moved
    bytes_moved: int = 0  # layer bytes that reached the device: the streamed layers'
    load_s: float = 0.0  # reader-thread seconds issuing them (on CPU: moving them), overlapped
    wait_s: float = 0.0  # seconds the pass sat waiting for weights
    pass_s: float = 0.0  # wall seconds of the whole pass, device work included

    @property
    def compute_s(self) -> float:  # everything that was not waiting
        return self.pass_s - self.wait_s

    @property
    def gb_per_s(self) -> float:
        return self.bytes_moved / self.pass_s / 1e9 if self.pass_s else 0.0


def bind(layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Point a decoder layer's parameters at these tensors (slot views, or meta to unbind)."""
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        layer.get_submodule(module)._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


class StreamedLayers:
    """Stands in for the Hugging Face model's list of decoder layers: iterating it streams them.

    The model's own forward (masks, rotary, cache) runs unchanged and loops over
    `self.layers[: config.num_hidden_layers]`; slicing gives the same stream over fewer layers.
    """

    def __init__(self, layers: nn.ModuleList, ring: LayerRing, layouts):
        self.layers, self.ring, self.layouts = layers, ring, layouts
        self.indices = range(len(layers))
        # between runs a decoder layer rests on meta tensors: shapes, no bytes
        self.unbound = [{n: p.data for n, p in layer.named_parameters()} for layer in layers]
        self.stats = PassStats()  # of the pass now running

    def __getitem__(self, index: slice) -> "StreamedLayers":
        streamed = copy.copy(self)  # shares the layers, the ring and this pass's stats
        streamed.indices = self.indices[index]
        return streamed

    def __iter__(self):
        ring, stats = self.ring, self.stats
        for i in self.indices:
            if i not in ring.kept:  # a resident layer is bound to a buffer of its own for good
                # prefetch next: the streamed layer `lookahead` on takes the slot the last one
                # released. Near the end this wraps around: the next pass's first layers load
                # during this pass's LM head.
                ring.prefetch(ring.after[i])

                # wait for this one: the reader has issued it and compute waits for it to land
                waiting = time.perf_counter()
                slot, load_s = ring.wait(i)
                stats.wait_s += time.perf_counter() - waiting
                stats.load_s += load_s
                stats.bytes_moved += self.layouts[i].nbytes
                bind(self.layers[i], ring.storage.views(i, slot))

            # compute: the Hugging Face decoder layer as it is, called by the model's forward
            yield partial(ring.ops.launch, self.layers[i])

            # release: back to meta, so only the ring holds weights and the slot may be refilled
            self.release()  # (a resident layer holds no slot: nothing to do)

    def release(self) -> None:
        """Unbind the layer in use, if any; also what an exception mid-pass leaves behind."""
        if self.ring.in_use is not None:
            bind(self.layers[self.ring.in_use.layer], self.unbound[self.ring.in_use.layer])
            self.ring.release()


class OffloadedCausalLM(nn.Module):
    """Called like the Hugging Face model it wraps; its decoder layers visit the device in turn."""

    def __init__(self, hf_model: nn.Module, storage, buffers: int, ops, n_resident: int = 0):
        super().__init__()
        self.layers = hf_model.model.layers  # their parameters: meta, or views of a slot
        del hf_model.model.layers  # a module list cannot be replaced by a plain object in place
        self.ring = LayerRing(storage, buffers, len(self.layers), n_resident, ops)
        self.streamed = StreamedLayers(self.layers, self.ring, storage.layouts)
        for i, buffer in self.ring.kept.items():  # resident: loaded and bound once, for good
            storage.load(i, buffer, ops)
            bind(self.layers[i], storage.views(i, buffer))
        ops.host_wait(ops.record("copy"))  # landed before any compute may read them
        hf_model.model.layers = self.streamed
        self.hf = hf_model  # all on the device, except the decoder layers' weights
        self.layouts = storage.layouts
        self.converted_folder: Path | None = None  # set by from_pretrained
        self.stats, self.closed = PassStats(resident_layers=len(self.ring.kept)), False

    config = property(lambda self: self.hf.config)
    generation_config = property(lambda self: self.hf.generation_config)
    device = property(lambda self: self.hf.lm_head.weight.device)
    dtype = property(lambda self: self.hf.lm_head.weight.dtype)
    pinned_bytes = property(lambda self: self.ring.ops.pinned_bytes)  # host memory pinned (CUDA)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, **kwargs):  # (batch, q); as the wrapped model's
        if self.closed:  # its reader thread and files are gone
            raise OffloadError("this offloaded model was closed; load it again to use it")
        started = time.perf_counter()
        # filled in as the pass goes
        self.stats = self.streamed.stats = PassStats(resident_layers=len(self.ring.kept))
        self.ring.start_pass()
        try:
            out = self.hf(input_ids.to(self.device), **kwargs)  # logits (batch, q, vocab)
        finally:
            self.streamed.release()  # after an exception, the layer it left bound
        # one host wait per pass, not per layer: pass_s then counts the device's work too
        self.ring.ops.host_wait(self.ring.ops.record("compute"))
        self.stats.pass_s = time.perf_counter() - started
        return out

    def close(self) -> None:
        if not self.closed:
            self.ring.close()
        self.closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- loading: from a model folder to storage, ring and model ----


def from_pretrained(
    name_or_path: "str | os.PathLike | models.Opened",
    *,
    mode: str = "ram",
    device: str | torch.device | Cpu | None = None,
    dtype: torch.dtype | str | None = None,
    offload_dir: str | os.PathLike | None = None,
    buffers: int = 2,
    quantize: str | None = None,
    device_memory: float | None = None,
    context: int | None = None,
) -> OffloadedCausalLM:
    """An offloaded causal LM from a model folder, a hub id or a folder models.open_model has
    opened and checked already (decoder layers at `model.layers`).

    mode "ram": every layer in one host arena; "ssd": layers read from safetensors every pass
    (the checkpoint's own files when their dtype fits, else a per-layer copy made in offload_dir,
    announced on stderr and named by `model.converted_folder`). device None: cuda if available,
    else cpu; a `Cpu`/`Cuda`-like object runs on it (tests pass a fake one). dtype None: the dtype
    stored in the checkpoint; "float16" and "torch.bfloat16" are read as torch dtypes. quantize
    "int8" or "int4": decoder-layer linear weights are stored and moved quantized (quantize.py)
    and dequantized into `dtype` on the device (ssd: always from a converted copy).
    device_memory: bytes the model may hold on the device (None: stream every layer); after the
    embeddings and head, a KV cache of `context` tokens (None: the config's max positions) and
    the ring's slots, as many decoder layers as fit stay resident and are never moved again.
    Activations need room beyond it. Every error is an OffloadError with a one-line message.
    """
    if mode not in ("ram", "ssd"):
        raise OffloadError(f"mode must be 'ram' or 'ssd', not {mode!r}")
    if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 1:
        raise OffloadError(f"buffers must be an integer of at least 1, not {buffers!r}")
    if quantize not in (None, *quant.KINDS):
        raise OffloadError(f"quantize must be None, 'int8' or 'int4', not {quantize!r}")
    ops = device  # the device's operations: Cpu, Cuda, or a test's fake
    if not isinstance(device, Cpu):
        device = models.as_device(device)
        ops = Cuda(device) if device.type == "cuda" else Cpu()
    opened = models.open_model(name_or_path)  # refused here iff in memory too
    config, ckpt = opened.config, opened.checkpoint
    dtype = models.as_dtype(dtype) or ckpt.dtype
    models.check_dtype_runs(ops.device, dtype)
    # the model on meta costs nothing; only the parts that stay on the device get real tensors
    hf = opened.skeleton(dtype)
    shapes = ckpt.check_layers(hf, quantize)  # what each decoder layer holds, the same for all
    models.load_weights(opened, hf, ops.device, dtype, layers=False)

    converted, n_layers = None, config.num_hidden_layers
    if mode == "ram":  # the arena, filled once the budget below is known to hold
        ram = storage = RamStorage(pack(quant.stored_layer(shapes, dtype, quantize)), n_layers, ops)
    else:  # the checkpoint's own files where they fit, else a converted copy
        layers, converted = files.disk_layers(ckpt, shapes, n_layers, dtype, quantize, offload_dir)
        storage = DiskStorage(layers, ops)
    if quantize is not None:  # a slot also holds the layer's dequantized weights
        storage = Dequantizing(storage, shapes, dtype, quantize)
    n_resident = 0
    if device_memory is not None:  # on the device anyway: the parts above, and keys and values
        # of every layer for `context` tokens; then a layer's slot each for the ring and the
        # resident layers. The ring needs `buffers` slots, unless no layer streams at all.
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        kv = 2 * n_layers * heads * head_dim * dtype.itemsize  # per token
        positions = context or config.max_position_embeddings  # the KV cache's
        fixed = kv * positions
        outside = (p for name, p in hf.named_parameters() if not name.startswith("model.layers."))
        fixed += sum(p.nbytes for p in outside)
        slots = (device_memory - fixed) / storage.slot_nbytes()  # how many fit; inf: all
        n_resident = n_layers if slots >= n_layers else int(slots) - buffers
        if n_resident < 0:
            raise OffloadError(
                f"device_memory {device_memory / 1e9:.3f} GB: the head and {positions} positions"
                f" of KV cache take {fixed / 1e9:.3f} GB, leaving too little for {buffers} slots"
            )
    if mode == "ram":
        ram.fill(ckpt, shapes, dtype, quantize)
    model = OffloadedCausalLM(hf, storage, buffers, ops, n_resident)
    model.converted_folder = converted
    return model


def self_draft(target, kind: str, **options) -> OffloadedCausalLM:
    """The target's own int8 or int4 copy as SpecExec's draft (SubSpec, 2025): the same
    tokenizer by construction and no second checkpoint. Every layer resident (nothing streams);
    `target` a folder, hub id or models.Opened, `options` as from_pretrained's (device, dtype).

    Each layer's buffer holds its weights dequantized into `dtype` beside the quantized bytes,
    and the matmuls run on those (no int8 / int4 kernels here): it computes exactly the quantized
    model, but holds more than the full model's bytes on the device, not a quarter of them.
    """
    if kind not in quant.KINDS:
        raise OffloadError(f"a self-draft is 'int8' or 'int4', not {kind!r}")
    return from_pretrained(target, mode="ram", quantize=kind, device_memory=math.inf, **options)
