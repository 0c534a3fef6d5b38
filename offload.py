"""Offloaded causal LM: decoder layers streamed through a small ring of device buffers.

SpecExec (Svirschevski et al., 2024, arXiv 2406.02532) targets models that do not fit in GPU
memory. Their weights live in RAM or on an SSD and every target pass streams all of them through
the device, so a pass costs about the same for one token or a thousand: a large draft tree rides
on bandwidth that is spent anyway. This module is that target. Embeddings, final norm, LM head,
rotary embedding and KV cache stay on the device; each decoder layer is copied into one of
`buffers` device slots just before it runs, the next one already on its way. Given
`device_memory`, as many layers as fit stay for good (UMbreLLa's resident layers).

| paper / idea                 | code                                                             |
| ---------------------------- | ---------------------------------------------------------------- |
| offloaded target model       | `OffloadedCausalLM`, built by `from_pretrained`                  |
| layer i+1 loads while i runs | `StreamedLayers.__iter__`: prefetch, wait, compute, release      |
| cost of one target pass      | `PassStats`: bytes moved, seconds waiting for weights, GB/s      |
| what is on the device now    | `LayerRing`: `buffers` slots, filled in order by one reader      |
| resident layers              | `device_memory=`: `LayerRing.resident`, loaded once, never moved |
| where the weights live       | storage: `RamStorage` (mode="ram"), `SsdStorage` (mode="ssd")    |
| int8 / int4 weights          | `Dequantizing` around either storage; arithmetic: quantize.py    |
| what a device must do        | `Cuda` (streams, events) and `Cpu`; tests add a fake one         |

Ordering on CUDA, without a host synchronize per layer: a load records a "ready" event on the
copy stream (quantized: on the dequant stream, after the copies), and compute waits on it on the
device; a release records a "freed" event on the compute stream, and the next copy into that slot
waits on it. The host blocks only before it refills a staging chunk whose copy may still be
running, and once at the end of a pass; only then are the pass's times read off its events.
"""

import concurrent.futures
import contextlib
import copy
import math
import numbers
import os
import time
import weakref
from collections import deque, namedtuple
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
from torch import nn
from tqdm import tqdm

from specexec_tools import OffloadError, models
from specexec_tools import checkpoint as files
from specexec_tools import quantize as quant

# Layer buffers, the ranges read into them and the tensors `pack` lays out start on pages: any
# dtype can view them, O_DIRECT reads land there, and matmul kernels find them aligned.
PAGE = 4096


# ---- the model: the Hugging Face model, its decoder layers streamed from the ring ----


class OffloadedCausalLM(nn.Module):
    """Called like the Hugging Face model it wraps; its decoder layers visit the device in turn."""

    def __init__(self, hf_model, storage, sizes, buffers, ops, n_resident, converted, kind):
        super().__init__()
        self.layers = hf_model.model.layers  # their parameters: meta, or views of a slot
        del hf_model.model.layers  # a module list cannot be replaced by a plain object in place
        self.ring = LayerRing(storage, sizes, buffers, len(self.layers), n_resident, ops)
        # closed, left by a `with`, dropped or at exit: thread, files, pinned memory given back once
        self.finalizer = weakref.finalize(self, self.ring.close)
        self.streamed = StreamedLayers(self.layers, self.ring)
        for i, buffer in self.ring.resident.items():  # loaded and bound once, for good
            ops.host_wait(storage.load_resident(i, buffer, ops))  # landed before compute reads it
            bind(self.layers[i], storage.resident_views(i, buffer))
        if not self.ring.order:  # nothing streams (a self-draft): the host copy is read no more
            storage.close()
        hf_model.model.layers = self.streamed
        self.hf = hf_model  # all on the device, except the decoder layers' weights
        self.config = hf_model.config
        self.generation_config = hf_model.generation_config
        self.device = hf_model.lm_head.weight.device
        self.dtype = hf_model.lm_head.weight.dtype
        self.streams = bool(self.ring.order)  # some layer moves every pass
        self.layouts = storage.layouts  # what each layer moves
        self.converted_folder = converted  # the ssd tier's copy, or None
        self.quantized = kind  # int8, int4 or None
        self.stats = PassStats(resident_layers=len(self.ring.resident))
        self.pass_costs = {}  # tokens -> (seconds, seconds not waiting for weights): time_passes
        self.ended = None  # when the last pass ended, if it ran to its end: its prefetch began

    @property
    def pinned_bytes(self) -> int:
        return self.ring.ops.pinned_bytes  # host memory pinned (CUDA)

    @property
    def closed(self) -> bool:
        return not self.finalizer.alive

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, **kwargs):  # (batch, q); as the wrapped model's
        if self.closed:  # its reader thread and files are gone
            raise OffloadError("this offloaded model was closed; load it again to use it")
        started = time.perf_counter()
        ops = self.ring.ops
        self.stats = PassStats(resident_layers=len(self.ring.resident))  # this pass's
        self.streamed.waits.clear()
        since = self.ended  # the link has loaded this pass's first layers since
        self.ended = None  # until this pass ends
        self.ring.start_pass()
        try:
            out = self.hf(input_ids.to(self.device), **kwargs)  # logits (batch, q, vocab)
            self.ring.prefetch_first()  # the next pass's first layers load behind the draft
            self.ring.whole = True  # what it prefetched for the next pass stays
        finally:
            self.streamed.release()  # after an exception, the layer it left bound
            if not self.ring.whole:  # stopped part-way (an exception, Ctrl-C): none of it stays
                self.ring.drain()
            self.stats.bytes_moved = sum(self.layouts[i].nbytes for i, *_ in self.streamed.waits)
        # one host wait per pass, not per layer: pass_s then counts the device's work too, and
        # every event of the pass has passed, so the device's own times can be read
        ops.host_wait(ops.record("compute"))
        self.stats.pass_s = time.perf_counter() - started
        self.stats.wait_s = sum(ops.seconds(*around) for _, *around in self.streamed.waits)
        self.stats.link_idle_s = self.ring.link_idle_s()
        if since is not None:  # all the while, but when it idled
            self.stats.ahead_s = max(0.0, started - since - self.stats.link_idle_s)
        self.ended = time.perf_counter()
        return out

    def time_passes(self, most=128) -> None:
        """Time a pass over `most` tokens, then one (warm), without a cache: budget auto sizes its
        first tree by what a pass costs and how much of it is compute (as Sequoia sizes its trees
        for the hardware before it runs)."""
        for n in (min(most, self.config.max_position_embeddings), 1):
            self(torch.zeros(1, n, dtype=torch.long))  # (1, n)
            self.pass_costs[n] = self.stats.pass_s, self.stats.pass_s - self.stats.wait_s

    def close(self) -> None:
        """Give back the reader thread, files and pinned memory; a second call does nothing."""
        self.finalizer()

    def __enter__(self) -> "OffloadedCausalLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class PassStats:
    """What the last forward pass cost (`model.stats`, replaced by every pass)."""

    resident_layers: int = 0  # decoder layers on the device for good: never moved
    bytes_moved: int = 0  # layer bytes that reached the device: the streamed layers'
    wait_s: float = 0.0  # seconds compute sat waiting for weights, on the device's clock
    pass_s: float = 0.0  # wall seconds of the whole pass, device work included
    # seconds the link sat idle before the pass began: the next pass's first layers had landed
    # while the draft still grew its tree (0: loads ran all along, or nothing was loading)
    link_idle_s: float = 0.0
    ahead_s: float = 0.0  # seconds the link loaded the pass's first layers before it began

    @property
    def gb_per_s(self) -> float:
        return self.bytes_moved / self.pass_s / 1e9 if self.pass_s else 0.0

    def summary(self, n_layers: int) -> str:
        """One line: the resident layers, and what the pass moved and waited for."""
        rate = f" ({self.gb_per_s:.2f} GB/s)" if self.bytes_moved > 1e8 else ""
        return (
            f"{self.resident_layers} of {n_layers} layers resident; the last target pass moved "
            f"{self.bytes_moved / 1e6:,.1f} MB in {self.pass_s:.3f}s{rate}, {self.wait_s:.3f}s "
            "of it waiting for weights"
        )


def bind(layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Point a decoder layer's parameters at these tensors (slot views, or meta to unbind)."""
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        layer.get_submodule(module)._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


class StreamedLayers:
    """Stands in for the Hugging Face model's list of decoder layers: iterating it streams them.
    The model's own forward (masks, rotary, cache) runs unchanged and loops over
    `self.layers[: config.num_hidden_layers]`; slicing gives the same stream over fewer layers."""

    def __init__(self, layers: nn.ModuleList, ring: "LayerRing"):
        self.layers = layers
        self.ring = ring
        self.indices = range(len(layers))  # the layers this stream runs (a slice: fewer)
        self.waits = []  # this pass's: (streamed layer, events on compute around its wait)
        # between runs a decoder layer rests on meta tensors: shapes, no bytes
        self.unbound = [{n: p.data for n, p in layer.named_parameters()} for layer in layers]

    def __getitem__(self, index: slice) -> "StreamedLayers":
        streamed = copy.copy(self)  # shares the layers, the ring and this pass's waits
        streamed.indices = self.indices[index]
        return streamed

    def __iter__(self):
        ring = self.ring
        for i in self.indices:
            if i not in ring.resident:  # a resident layer is bound to a buffer of its own for good
                # prefetch next: the streamed layer `ring.after[i]` takes the slot released last;
                # near the end, the next pass's first layers (they load during the LM head)
                ring.prefetch(ring.after[i])

                # wait for this one: the reader has issued it and compute waits for it to land;
                # events on the compute stream around that wait time it as the device sees it
                waiting = ring.ops.record("compute")
                slot = ring.wait(i)
                self.waits.append((i, waiting, ring.ops.record("compute")))
                # bound in the compute stream's order: a device that queues a whole pass ahead
                # runs each layer on what was bound when its kernels were queued
                ring.ops.launch(bind, self.layers[i], ring.storage.views(i, slot))

            # compute: the Hugging Face decoder layer as it is, called by the model's forward
            yield partial(ring.ops.launch, self.layers[i])

            # release: back to meta, so only the ring holds weights and the slot may be refilled
            self.release()  # (a resident layer holds none)

    def release(self) -> None:
        """Unbind the layer in use, if any; also what an exception mid-pass leaves behind."""
        if self.ring.in_use is not None:
            layer = self.ring.in_use.layer
            self.ring.ops.launch(bind, self.layers[layer], self.unbound[layer])
            self.ring.release()


# ---- loading: from a model folder to storage, ring and model ----


def from_pretrained(
    name_or_path: "str | os.PathLike | models.Opened",
    *,
    mode: str = "ram",
    device: "str | torch.device | Cpu | None" = None,
    dtype: torch.dtype | str | None = None,
    offload_dir: str | os.PathLike | None = None,
    buffers: int = 2,
    quantize: str | None = None,
    device_memory: float | None = None,
    context: int | None = None,
) -> OffloadedCausalLM:
    """An offloaded causal LM from a model folder, a hub id or a models.Opened (decoder layers at
    `model.layers`); every error an OffloadError with a one-line message. mode "ram": every layer
    in one host arena; "ssd": layers read from safetensors every pass (the checkpoint's own files
    when their dtype fits, else a per-layer copy made in offload_dir, announced on stderr and named
    by `model.converted_folder`). device None: cuda if available, else cpu (or a `Cpu`/`Cuda`-like
    object). dtype None: the checkpoint's ("float16", "torch.bfloat16" read as dtypes). quantize
    "int8" / "int4": linear weights stored and moved quantized. device_memory: bytes the model may
    hold on the device, activations aside (None: stream every layer); beside the head, a KV cache
    of `context` tokens (None: max positions) and the ring, as many layers as fit stay resident."""
    if mode not in ("ram", "ssd"):
        raise OffloadError(f"mode must be 'ram' or 'ssd', not {mode!r}")
    if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers < 1:
        raise OffloadError(f"buffers must be an integer of at least 1, not {buffers!r}")
    if quantize not in (None, *quant.KINDS):
        raise OffloadError(f"quantize must be None, 'int8' or 'int4', not {quantize!r}")
    number = isinstance(device_memory, numbers.Real) and not isinstance(device_memory, bool)
    if device_memory is not None and not (number and device_memory >= 0):  # NaN fails too
        raise OffloadError(f"device_memory must be a number of bytes, not {device_memory!r}")
    whole = isinstance(context, numbers.Integral) and not isinstance(context, bool)
    if context is not None and not (whole and context > 0):
        raise OffloadError(f"context must be a positive number of tokens, not {context!r}")
    files.check_offload_dir(offload_dir)  # before anything is read
    ops = device  # the device's operations: Cpu, Cuda, or a test's fake
    if not isinstance(device, Cpu):
        device = models.as_device(device)
        ops = Cuda(device) if device.type == "cuda" else Cpu()
    opened = models.open_model(name_or_path)  # refused here iff in memory too
    ckpt = opened.checkpoint
    n_layers = opened.config.num_hidden_layers
    dtype = models.as_dtype(dtype) or ckpt.dtype
    models.check_dtype_runs(ops.device, dtype)
    # on meta: only the parts that stay on the device get bytes
    hf = models.skeleton(opened.config, opened.folder, dtype)
    shapes = ckpt.check_layers(hf, quantize)  # what each decoder layer holds, the same for all
    sizes = slot_sizes(ckpt, shapes, n_layers, dtype, quantize, mode == "ssd" and not ops.staging)
    n_resident = 0
    if device_memory is not None:  # refused or met before anything is read, pinned or converted
        n_resident = count_resident(hf, dtype, device_memory, context, buffers, sizes)
    models.load_weights(opened, hf, ops.device, dtype, layers=False)

    with contextlib.ExitStack() as undo:  # failing from here on, give back what was taken
        undo.callback(ops.close)
        if mode == "ram":  # every layer into one arena: the big read
            converted = None
            storage = RamStorage(pack(quant.stored_layer(shapes, dtype, quantize)), n_layers, ops)
            undo.callback(storage.close)
            storage.fill(ckpt, shapes, dtype, quantize)
        else:  # the checkpoint's own files where they fit, else a converted copy
            at, converted = files.ssd_layers(ckpt, shapes, n_layers, dtype, quantize, offload_dir)
            storage = SsdStorage(at, ops)
            undo.callback(storage.close)
        assert max(layout.nbytes for layout in storage.layouts) <= sizes.moved, "outgrows a slot"
        if quantize is not None:  # a slot also holds the layer's dequantized weights
            storage = Dequantizing(storage, shapes, dtype, quantize, sizes)
        model = OffloadedCausalLM(hf, storage, sizes, buffers, ops, n_resident, converted, quantize)
        undo.pop_all()  # the model's own now: its close() or finalizer gives them back
    return model


# Bytes on the device: what a load moves into a slot, a ring slot, a resident layer's buffer
SlotSizes = namedtuple("SlotSizes", "moved slot resident")


def slot_sizes(ckpt, shapes: dict, n_layers: int, dtype, kind, straight: bool) -> SlotSizes:
    """A layer's bytes on the device, from the config and the headers alone: one sizing for the
    budget and the storages. `straight`: ssd reads land in the slot as their files lay them out."""
    stored = quant.stored_layer(shapes, dtype, kind)  # meta: what storage holds of a layer
    moved = pack(stored).nbytes  # ram, or ssd through staging: the tensors as pack lays them
    if straight:  # a copy is one file, its tensors end to end after a header in the first page
        moved = round_up(sum(t.nbytes for t in stored.values())) + PAGE
        in_place = [ckpt.layer_entries(i, shapes) for i in range(n_layers)]
        if kind is None and all(e for layer in in_place for e in layer.values()):
            moved = max([moved, *(plan_reads(layer)[0].nbytes for layer in in_place)])
    if kind is None:
        return SlotSizes(moved, moved, moved)
    weights, plain = dequantized_layouts(shapes, dtype)
    return SlotSizes(moved, moved + weights.nbytes, plain.nbytes)


def count_resident(hf, dtype, device_memory, context, buffers, sizes: SlotSizes) -> int:
    """The most k layers whose buffers, with the ring's min(buffers, n - k) slots, fit in
    `device_memory` beside the parts outside the decoder layers and a KV cache of `context`."""
    config = hf.config
    n_layers = config.num_hidden_layers
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    positions = context or config.max_position_embeddings  # the KV cache's
    fixed = 2 * n_layers * heads * head_dim * dtype.itemsize * positions
    fixed += sum(p.nbytes for n, p in hf.named_parameters() if not n.startswith("model.layers."))
    fits = [
        k
        for k in range(n_layers + 1)
        if fixed + k * sizes.resident + min(buffers, n_layers - k) * sizes.slot <= device_memory
    ]
    if not fits:
        raise OffloadError(
            f"device_memory {device_memory / 1e9:.3f} GB: the head and {positions} positions of "
            f"KV cache take {fixed / 1e9:.3f} GB, leaving too little for {buffers} slots"
        )
    return max(fits)


def self_draft(target, kind: str, **options) -> OffloadedCausalLM:
    """The target's own int8 or int4 copy as SpecExec's draft (SubSpec, 2025): the same tokenizer,
    no second checkpoint, every layer resident; `options` as from_pretrained's. Held dequantized
    (no int8 / int4 kernels here): the quantized model's outputs at the full model's bytes."""
    if kind not in quant.KINDS:
        raise OffloadError(f"a self-draft is 'int8' or 'int4', not {kind!r}")
    return from_pretrained(target, mode="ram", quantize=kind, device_memory=math.inf, **options)


# ---- the ring: what is on the device right now ----


Load = namedtuple("Load", "layer slot issued")  # issued: a future of its "ready" event


class LayerRing:
    """`buffers` device slots, filled by one reader thread in the order the layers will run, and
    the resident layers' buffers. Slots go round-robin, so a new load takes the slot of the layer
    released last: at most `buffers` streamed layers are in flight, landed or running at once."""

    def __init__(self, storage, sizes, buffers: int, n_layers: int, n_resident: int, ops):
        self.storage = storage
        self.sizes = sizes
        self.ops = ops
        # resident layers spread evenly through the pass: while one computes, the next streamed
        # layer keeps loading, where a block of them would leave the stream idle that long
        spread = [(j + 1) * n_layers // n_resident - 1 for j in range(n_resident)]
        self.resident = {i: ops.device_buffer(sizes.resident) for i in spread}  # (resident,)
        self.order = [i for i in range(n_layers) if i not in self.resident]  # the streamed layers
        self.slots = [ops.device_buffer(sizes.slot) for _ in self.order[:buffers]]  # (slot,)
        self.freed = [None] * len(self.slots)  # each slot's last release, an event on compute
        ahead = max(0, len(self.slots) - 1)  # streamed layers loading while one computes
        # prefetched as each streamed layer starts: the one `ahead` on (past the end: wrapped)
        self.after = dict(zip(self.order, self.order[ahead:] + self.order[:ahead]))
        self.reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offload-reader")
        self.queue = deque()  # Loads in the order they will be used, not yet handed out
        self.in_use = None  # the Load handed out by wait(), not yet released
        self.whole = True  # the last pass ran to its end (see start_pass)
        self.idle_from = None  # the last load's "ready" event, if it landed before this pass
        self.idle_until = None  # this pass's start, an event on the copy stream

    def start_pass(self) -> None:
        """Keep what the last pass prefetched for its first layers; start from nothing loaded
        after a pass that stopped part-way (even in its own clean-up: a second Ctrl-C), or one
        over fewer layers."""
        # the link idles from its last load's landing until now; a load that failed raises its
        # error where the pass waits for its layer, not here
        last = self.queue[-1].issued if self.queue else None
        landed = last is not None and last.done() and last.exception() is None
        self.idle_from = last.result() if landed else None
        self.idle_until = self.ops.record("copy")  # before this pass's first copies are queued
        if not self.whole or (self.queue and self.queue[0].layer != self.order[0]):
            self.drain()
        self.whole = False  # until this pass has run to its end
        self.prefetch_first()

    def link_idle_s(self) -> float:
        """Seconds the link sat idle before this pass began, once the pass's events have passed."""
        if self.idle_from is None:
            return 0.0
        return max(0.0, self.ops.seconds(self.idle_from, self.idle_until))

    def prefetch_first(self) -> None:
        """The next pass's first layers, one per free slot. Issued as a pass ends, they load
        while the draft grows the next tree: the link need not idle while the draft works."""
        for layer in self.order[: len(self.slots)]:
            self.prefetch(layer)

    def prefetch(self, layer: int) -> None:
        if any(load.layer == layer for load in self.queue):
            return
        assert len(self.queue) + (self.in_use is not None) < len(self.slots), "the ring is full"
        # the slot after the newest one taken, read off the loads themselves: a Ctrl-C anywhere
        # in here leaves no slot counted as taken that no load holds, or held but counted free
        newest = self.queue[-1] if self.queue else self.in_use
        slot = 0 if newest is None else (newest.slot + 1) % len(self.slots)
        issue = partial(self._load, layer, slot, self.freed[slot])
        if self.ops.queues and not self.storage.reads_ssd:
            # RAM to a GPU: the copy is only queued, so it is issued here. On the reader thread
            # it would wait for the interpreter while this thread queues kernels (on an H100 the
            # copy engine then idled a third of a pass: docs/results.md, "On a GPU")
            issued = concurrent.futures.Future()
            issued.set_result(issue())
        else:  # ssd reads, or copies that run as issued: on the reader thread, beside compute
            issued = self.reader.submit(issue)
        self.queue.append(Load(layer, slot, issued))

    def _load(self, layer: int, slot: int, freed):
        if freed is not None:  # the slot's last occupant has run: only then overwrite it
            self.ops.wait_event("copy", freed)
        return self.storage.load(layer, self.slots[slot], self.ops)

    def wait(self, layer: int) -> torch.Tensor:
        """Compute waits (on the device) until `layer` has landed in the slot returned. The host
        first waits for the reader to have issued the load: an event is waited on once recorded."""
        load = self.queue.popleft()
        assert load.layer == layer, f"the ring holds layer {load.layer} next, not {layer}"
        self.ops.wait_event("compute", load.issued.result())
        self.in_use = load
        return self.slots[load.slot]

    def release(self) -> None:
        """The slot in use may be refilled once the compute queued so far has run."""
        self.freed[self.in_use.slot] = self.ops.record("compute")
        self.in_use = None

    def drain(self) -> None:
        """Back to nothing loaded: the slot in use released, every load issued run and forgotten.
        (On a device, a dropped load's work still queued comes before the next load's into that
        slot on their streams: the last to write its weights is the next.)"""
        if self.in_use is not None:
            self.release()
        self.reader.submit(lambda: None).result()  # every load handed to the reader has run
        self.queue.clear()

    def close(self) -> None:
        """Given back in order: loads issued, the host memory they read, the streams; then slots."""
        self.reader.shutdown()  # once every load handed to it has run
        self.storage.close()
        self.ops.close()


# ---- storage: where each layer's bytes live, and how they reach a slot ----


TensorSpec = namedtuple("TensorSpec", "offset dtype shape")  # offset: bytes into a layer buffer


class Layout(NamedTuple):
    """How one layer's tensors sit in its flat byte buffer."""

    tensors: dict[str, TensorSpec]  # name inside the layer, e.g. "self_attn.q_proj.weight"
    nbytes: int

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed, shaped views of a flat uint8 buffer; no copy."""
        views = {}
        for name, (at, dtype, shape) in self.tensors.items():
            nbytes = math.prod(shape) * dtype.itemsize
            views[name] = buffer[at : at + nbytes].view(dtype).view(shape)
        return views


def pack(tensors: dict) -> Layout:
    """Tensors (meta, or files.Entry) end to end, each on a page: a RAM or staged slot's layout."""
    specs = {}
    offset = 0
    for name, tensor in tensors.items():
        specs[name] = TensorSpec(offset, tensor.dtype, tuple(tensor.shape))
        offset += round_up(math.prod(tensor.shape) * tensor.dtype.itemsize)
    return Layout(specs, offset)


def round_up(nbytes: int) -> int:  # to whole pages
    return -(-nbytes // PAGE) * PAGE


class Storage:
    """Where layers' bytes live. `layouts[i]`: what a load of layer i moves into a slot; `load`
    queues that and returns the event compute waits for; `load_resident`: once, for good."""

    reads_ssd = False  # whether a load blocks the host on the SSD

    def views(self, layer: int, slot: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.layouts[layer].views(slot)  # the decoder layer's parameters

    def resident_views(self, layer: int, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.layouts[layer].views(buffer)  # a resident layer's buffer is a slot

    def load_resident(self, layer: int, buffer: torch.Tensor, ops):
        return self.load(layer, buffer, ops)  # as into a slot


class RamStorage(Storage):
    """All layers in ONE host arena (pinned on CUDA), one region per layer: one copy moves it."""

    def __init__(self, layout: Layout, n_layers: int, ops):
        self.layouts = [layout] * n_layers  # every layer's layout; whole pages
        self.ops = ops
        self.arena = ops.host_buffer(n_layers * layout.nbytes)  # pinned on CUDA: no bounce
        self.buffers = [self.arena[i * layout.nbytes :][: layout.nbytes] for i in range(n_layers)]

    def fill(self, ckpt: "files.Checkpoint", shapes: dict, dtype, kind) -> None:
        """Every layer into the arena, quantized as `kind` says: the big read, done once."""
        what = f"quantizing layers to {kind}" if kind else "loading layers"  # a self-draft: int4
        for i in tqdm(range(len(self.layouts)), desc=f"offload: {what} in RAM"):
            views = self.layouts[i].views(self.buffers[i])
            for name, tensor in quant.quantize_layer(ckpt.layer(i, shapes), dtype, kind).items():
                views[name].copy_(tensor)

    def load(self, layer: int, slot: torch.Tensor, ops):
        ops.copy(slot[: self.layouts[layer].nbytes], self.buffers[layer])
        return ops.record("copy")

    def close(self) -> None:
        if self.buffers:  # unpinned once its copies have run
            self.ops.free_host(self.arena)
            self.arena = None
            self.buffers = []


# One pread: `nbytes` of `path` from `file_offset` (whole pages asked) to `buffer_offset`
Read = namedtuple("Read", "path file_offset nbytes buffer_offset")


def plan_reads(entries: dict[str, files.Entry]) -> tuple[Layout, list[Read]]:
    """Merge one layer's tensors into page-aligned ranges of their files, one read per range (a
    layer is usually one range per file): a tensor sits in the buffer where it sat in its file,
    shifted by where its range landed."""
    tensors = {}
    reads = []
    for name, entry in sorted(entries.items(), key=lambda item: (str(item[1].path), item[1].start)):
        last = reads[-1] if reads else None
        covered = last.file_offset + round_up(last.nbytes) if last else 0  # the range's file end
        if not (last and last.path == entry.path and entry.start <= covered):  # a new range
            end = last.buffer_offset + round_up(last.nbytes) if last else 0  # its buffer end
            reads.append(Read(entry.path, entry.start // PAGE * PAGE, 0, end))
        reads[-1] = reads[-1]._replace(nbytes=entry.end - reads[-1].file_offset)  # to its end
        last = reads[-1]
        offset = last.buffer_offset + entry.start - last.file_offset
        tensors[name] = TensorSpec(offset, entry.dtype, entry.shape)
    return Layout(tensors, reads[-1].buffer_offset + round_up(reads[-1].nbytes)), reads


class SsdStorage(Storage):
    """Layers stay in safetensors files; a layer is a few preads, two in flight (an SSD serves a
    queue faster than one read), straight into the slot (O_DIRECT; tensors keep their file's
    alignment) or, where the device reads no host memory, into pinned staging chunks copied on
    tensor by tensor to where `pack` puts each; a chunk is read into again once its copy ran."""

    piece_nbytes = 32 * 2**20  # the most one pread asks for (through staging: a chunk)
    reads_ssd = True

    def __init__(self, layers: list[dict[str, files.Entry]], ops):
        self.layouts, self.reads = zip(*(plan_reads(entries) for entries in layers), strict=True)
        if ops.staging:  # copied on from staging: each tensor where `pack` puts it
            self.layouts = [pack(entries) for entries in layers]
        self.entries = layers  # name -> where in its file, per layer
        self.ops = ops
        # what close() gives back, however far __init__ got before failing
        self.fds = {}
        self.chunks = []
        self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="offload-ssd")
        try:
            for path in {read.path for reads in self.reads for read in reads}:
                self.fds[path] = files.open_direct(path)
            if ops.staging:  # the device reads no host memory: (how many chunks, bytes each)
                count, self.piece_nbytes = ops.staging
                for _ in range(count):
                    self.chunks.append(ops.host_buffer(self.piece_nbytes))  # (chunk,)
        except BaseException:
            self.close()
            raise
        self.copied = [None] * len(self.chunks)  # each chunk's last copy
        self.next = 0  # the next read's chunk

    def load(self, layer: int, slot: torch.Tensor, ops):
        """Read a layer into `slot` (page-aligned): straight in, or chunk by chunk via staging."""
        most = self.piece_nbytes  # each range in pieces of whole pages, one pread each
        pieces = [
            Read(r.path, r.file_offset + s, min(most, r.nbytes - s), r.buffer_offset + s)
            for r in self.reads[layer]
            for s in range(0, r.nbytes, most)
        ]
        reading = deque()  # (piece, its staging chunk k or None, its pread), oldest first
        try:
            for piece in pieces:
                k = None  # no staging chunk: the SSD writes straight into the slot
                if self.chunks:  # the device reads no host memory: through staging chunk k
                    if len(reading) == min(2, len(self.chunks)):  # the oldest read's chunk goes on
                        self.copy_on(layer, slot, *reading.popleft(), ops)
                    k = self.next
                    self.next = (k + 1) % len(self.chunks)
                    if self.copied[k] is not None:  # its last copy may still be reading it
                        ops.host_wait(self.copied[k])
                into = self.chunks[k] if self.chunks else slot[piece.buffer_offset :]
                into = into[: round_up(piece.nbytes)]  # whole pages, as O_DIRECT reads them
                args = self.fds[piece.path], into, piece.file_offset, piece.path, piece.nbytes
                reading.append((piece, k, self.pool.submit(files.pread_into, *args)))
            while reading:
                self.copy_on(layer, slot, *reading.popleft(), ops)
        finally:  # after a failed read, no other still writes into a chunk or the slot
            concurrent.futures.wait([pread for *_, pread in reading])
        return ops.record("copy")

    def copy_on(self, layer: int, slot: torch.Tensor, piece: Read, k, pread, ops) -> None:
        """Once `piece` is in: from staging chunk k, each tensor's bytes in it to its slot place."""
        pread.result()
        if k is None:  # it was read straight into the slot
            return
        lo = piece.file_offset  # where the chunk's bytes were in the file: lo up to hi
        hi = piece.file_offset + piece.nbytes
        for name, entry in self.entries[layer].items():
            start = max(entry.start, lo)  # the tensor's bytes in the chunk
            end = min(entry.end, hi)
            if entry.path == piece.path and start < end:
                at = self.layouts[layer].tensors[name].offset + start - entry.start
                ops.copy(slot[at : at + end - start], self.chunks[k][start - lo : end - lo])
        self.copied[k] = ops.record("copy")  # on the copy stream, while the next reads run

    def close(self) -> None:
        self.pool.shutdown()  # reads in flight finish before their files close
        for fd in self.fds.values():
            os.close(fd)
        for chunk in self.chunks:
            self.ops.free_host(chunk)
        self.fds = {}
        self.chunks = []


def dequantized_layouts(shapes: dict, dtype: torch.dtype) -> tuple[Layout, Layout]:
    """A quantized layer's linear weights in the compute dtype (a slot's, after the moved bytes),
    and the whole layer as compute reads it (a resident layer's buffer)."""
    plain = quant.stored_layer(shapes, dtype, None)  # meta tensors in the compute dtype
    return pack({n: w for n, w in plain.items() if quant.is_weight(n)}), pack(plain)


class Dequantizing(Storage):
    """Quantized layers (quantize.py) in the ram or ssd storage it wraps. A slot holds the bytes
    that moved (`layouts`), then the weights dequantized from them on a stream of its own (the
    copy stream goes on meanwhile; "ready" is the dequantizing's). Resident: what compute reads."""

    def __init__(self, storage: Storage, shapes: dict, dtype, kind: str, sizes: SlotSizes):
        self.storage = storage
        self.layouts = storage.layouts  # what a load moves: the quantized layer
        self.reads_ssd = storage.reads_ssd
        self.kind = kind
        self.sizes = sizes
        self.weights, self.plain = dequantized_layouts(shapes, dtype)

    def load(self, layer: int, slot: torch.Tensor, ops):
        ops.wait_event("dequant", self.storage.load(layer, slot, ops))  # once the bytes moved
        weights = self.weights.views(slot[self.sizes.moved :])
        ops.convert(quant.dequantize_layer, self.layouts[layer].views(slot), weights, self.kind)
        return ops.record("dequant")

    def resident_views(self, layer: int, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.plain.views(buffer)  # as compute reads them

    def load_resident(self, layer: int, buffer: torch.Tensor, ops):
        """Through a slot of its own, then what compute reads into `buffer`; the slot goes after."""
        slot = ops.device_buffer(self.sizes.slot)  # (slot,)
        ops.wait_event("copy", self.load(layer, slot, ops))
        resident = self.resident_views(layer, buffer)
        for name, tensor in self.views(layer, slot).items():
            ops.copy(resident[name], tensor)
        ops.host_wait(ops.record("copy"))
        return ops.record("copy")

    def views(self, layer: int, slot: torch.Tensor) -> dict[str, torch.Tensor]:
        """The decoder layer's parameters: norms and biases as moved, weights dequantized."""
        moved = super().views(layer, slot)
        as_moved = {name: t for name, t in moved.items() if not name.endswith((".q", ".scale"))}
        return as_moved | self.weights.views(slot[self.sizes.moved :])

    def close(self) -> None:
        self.storage.close()


# ---- the device: what the ring asks of it (buffers, copies, events), on CUDA or the CPU ----


def page_aligned(nbytes: int, device: torch.device) -> torch.Tensor:
    """(nbytes,) uint8 starting on a page boundary, where an O_DIRECT read may land."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, device=device)
    return raw[(skip := -raw.data_ptr() % PAGE) : skip + nbytes]


class Cpu:
    """Each "stream" is the thread that issues its work (copy and dequant: the reader; compute: the
    caller), run in order: an event is done once recorded, the time it was, and waits are free.

    `link_gb_per_s`: the paper's regime on any machine. Each copy into a slot takes its bytes over
    that bandwidth, beside compute, as a GPU's copy stream moves a layer over PCIe: with mode="ram"
    and a link slow against compute (a 70B model's 36 GB against an H100's), a pass over a big tree
    costs about what one over a token does. It shows the regime, not any hardware's speed."""

    staging = None  # slots are host memory, where an ssd read lands directly
    queues = False  # copies run when issued, on the issuing thread (the reader's, beside compute)
    device = torch.device("cpu")
    pinned_bytes = 0
    link_gb_per_s = None

    def __init__(self, link_gb_per_s: float | None = None):
        if link_gb_per_s is not None and not link_gb_per_s > 0:  # NaN fails too
            raise OffloadError(f"link_gb_per_s must be a positive speed, not {link_gb_per_s!r}")
        self.link_gb_per_s = link_gb_per_s

    def record(self, stream: str) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:  # between two events that have passed
        return end - start

    def wait_event(self, stream: str, event) -> None:
        """Work issued on `stream` from now waits for `event`: here, already passed."""

    def host_wait(self, event) -> None:
        """The host waits for `event`: here, already passed."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return page_aligned(nbytes, torch.device("cpu"))  # (nbytes,)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return page_aligned(nbytes, torch.device("cpu"))  # (nbytes,)

    def free_host(self, buffer: torch.Tensor) -> None:
        """Nothing pinned, nothing to give back."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        started = time.perf_counter()
        dst.copy_(src)
        if self.link_gb_per_s is not None:  # the rest of the time the bytes would take the link
            link_s = dst.nbytes / (self.link_gb_per_s * 1e9)
            time.sleep(max(0.0, started + link_s - time.perf_counter()))

    def launch(self, fn, *args, **kwargs):  # compute
        return fn(*args, **kwargs)

    def convert(self, fn, *args) -> None:  # dequantizing, after the copies it waits for
        fn(*args)

    def close(self) -> None:
        """No streams, nothing pinned."""


class Cuda(Cpu):
    """A copy stream and a dequant stream beside the compute (current) stream, ordered by events,
    never the host. Host memory is pinned byte for byte (cudaHostRegister; `pin_memory=True` rounds
    up to a power of two: 16 GiB for 12). The tests run its ordering on a fake device."""

    staging = (4, 32 * 2**20)  # pinned chunks an ssd read passes through: (count, bytes each)
    queues = True  # a copy is queued on the copy stream and the host goes on at once

    def __init__(self, device: torch.device):
        self.device = device
        self.registered = []  # host buffers pinned, until freed
        self.pinned_bytes = 0
        self.streams = {name: torch.cuda.Stream(device) for name in ("copy", "dequant")}

    def stream(self, name: str) -> torch.cuda.Stream:
        """The copy or dequant stream; compute: the current one."""
        return self.streams.get(name) or torch.cuda.current_stream(self.device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = page_aligned(nbytes, torch.device("cpu"))  # (nbytes,)
        if int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)) != 0:
            raise OffloadError(f"cannot pin {nbytes / 1e9:.2f} GB of host memory for {self.device}")
        self.registered.append(buffer)
        self.pinned_bytes += nbytes
        return buffer

    def free_host(self, buffer: torch.Tensor) -> None:
        """Unpin a host buffer, once no copy queued so far can still be reading it."""
        self.streams["copy"].synchronize()
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
        self.registered = [pinned for pinned in self.registered if pinned is not buffer]
        self.pinned_bytes -= buffer.numel()

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = page_aligned(nbytes, self.device)  # (nbytes,)
        for stream in self.streams.values():  # freed, the caching allocator hands this memory
            buffer.record_stream(stream)  # out again only once their work queued by then has run
        return buffer

    def record(self, stream: str) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)  # new per record: never waited unrecorded
        event.record(self.stream(stream))
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def wait_event(self, stream: str, event: torch.cuda.Event) -> None:
        self.stream(stream).wait_event(event)  # on the device: the host goes on

    def host_wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.streams["copy"]):
            dst.copy_(src, non_blocking=True)

    def convert(self, fn, *args) -> None:
        with torch.cuda.stream(self.streams["dequant"]):
            fn(*args)

    def close(self) -> None:
        for buffer in list(self.registered):  # what a storage left pinned (normally nothing)
            self.free_host(buffer)
        for stream in self.streams.values():
            stream.synchronize()  # nothing of ours still runs once the model is gone
