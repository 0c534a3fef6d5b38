"""A model folder's weight files: safetensors headers, .bin shards, and the ssd tier's copy.

`Checkpoint` finds each tensor of a model folder (a byte range of a safetensors shard, or a tensor
memory-mapped from a .bin shard), for both tiers: in memory (models.load) and offloaded
(offload.py). `ssd_layers` writes the per-layer safetensors copy that the ssd tier reads when the
checkpoint's own files cannot be read as they are (another dtype, .bin, quantized). The checks of
a folder as a whole (config, family, every weight present) are models.open_model's.
"""

import copy
import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import threading
import zipfile
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from specexec_tools import OffloadError, expanded, one_line, quantize

# One tensor of a safetensors file, as the file's header describes it; start and end: absolute
# byte offsets in the file
Entry = namedtuple("Entry", "path dtype shape start end")


def pread_into(fd: int, buffer: torch.Tensor, file_offset: int, path: Path, needed=None) -> None:
    """Read into a host uint8 buffer from `file_offset` until `needed` bytes (default: all) are in.

    pread may return short, so loop; a page-rounded read may also run into the end of the file.
    """
    target = memoryview(buffer.numpy())
    needed = needed or len(buffer)
    done = 0
    while done < needed:
        try:
            got = os.preadv(fd, [target[done:]], file_offset + done)
        except OSError as err:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            direct = getattr(os, "O_DIRECT", 0)
            if err.errno != errno.EINVAL or not flags & direct:
                raise OffloadError(f"cannot read {path}: {err.strerror or err}") from None
            # a filesystem that took O_DIRECT at open and refuses the read (or a short read
            # left us unaligned): this descriptor reads through the page cache from now on
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~direct)
            continue
        if got == 0:
            raise OffloadError(
                f"truncated safetensors shard {path}: ends before {file_offset + done}"
            )
        done += got


def open_direct(path: Path) -> int:
    """A file descriptor that reads with O_DIRECT where the filesystem allows it (tmpfs doesn't).

    O_DIRECT lets the disk write straight into our buffer. A buffered read costs a copy out of the
    page cache, measured here at ~0.7 CPU-seconds per GB: CPU time the layer's compute needs.
    """
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return os.open(path, os.O_RDONLY)


DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DTYPES |= {"I8": torch.int8, "U8": torch.uint8}  # quantized levels (quantize.py)


def read_header(path: Path) -> dict[str, Entry]:
    """Parse a safetensors header (8-byte little-endian length + JSON) and check it as the
    safetensors library does: in the order of their offsets, each tensor's bytes start where the
    last one's end and are exactly its shape's in its dtype, and the last end at the file's end.
    (A range shorter than its tensor streamed the next one's bytes as weights; two tensors on
    one range ran as if all was well.)"""
    size = path.stat().st_size
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if 8 + length > size:  # a file of less than 8 bytes too
            raise OffloadError(f"truncated safetensors shard {path}: header runs past the end")
        try:
            header = json.loads(file.read(length))
            header.pop("__metadata__", None)
            infos = {n: (i["dtype"], i["data_offsets"], i["shape"]) for n, i in header.items()}
            infos = {
                n: (d, int(a), int(b), tuple(map(int, s))) for n, (d, (a, b), s) in infos.items()
            }
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise OffloadError(f"corrupt safetensors shard {path}: header is not one") from None
    base = 8 + length  # the header's offsets count from its end
    entries = {}
    end = 0  # where the tensors so far end: each must start there (the safetensors library's rule)
    for name, (dtype, start, stop, shape) in sorted(infos.items(), key=lambda item: item[1][1:3]):
        if dtype not in DTYPES:
            raise OffloadError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if start != end or stop - start != nbytes or min(shape, default=0) < 0:
            raise OffloadError(
                f"corrupt safetensors shard {path}: tensor {name} lies at bytes {start}..{stop}, "
                f"not {end}..{end + nbytes} ({dtype} {list(shape)}, after the one before it)"
            )
        entries[name] = Entry(path, DTYPES[dtype], shape, base + start, base + stop)
        end = stop
    if base + end > size:
        raise OffloadError(
            f"truncated safetensors shard {path}: {size} bytes, header says {base + end}"
        )
    if base + end < size:
        raise OffloadError(
            f"corrupt safetensors shard {path}: {size - base - end} bytes after its last tensor"
        )
    return entries


def index_shards(index: Path) -> list[Path]:
    """The shards a checkpoint index (model.safetensors.index.json) names: files of its own
    folder, by name (no ../.., absolute path or another folder's file, opened and unpickled)."""
    try:  # "metadata" (the total size) is optional: the weight map is what we read
        files = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise OffloadError(f"corrupt checkpoint index {index}") from None
    for file in files:
        if not isinstance(file, str) or file in ("", "..") or Path(file).name != file:
            raise OffloadError(f"corrupt checkpoint index {index}: {file!r} is no file name")
    return sorted(index.parent / file for file in files)


class Checkpoint:
    """The tensors of a model folder: safetensors shards (read by byte range) or .bin shards."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.shards = []
        self.entries = {}  # name -> Entry: where a safetensors tensor's bytes are
        self.mapped = {}  # name -> a .bin tensor, memory-mapped by torch.load
        self.sources = {}  # model name -> how it is built (`name_as`)
        try:
            for weights in ("model.safetensors", "pytorch_model.bin"):  # safetensors' first
                index = folder / f"{weights}.index.json"
                if index.exists():
                    self.shards = index_shards(index)
                elif (folder / weights).exists():
                    self.shards = [folder / weights]
                if self.shards:
                    break
            for shard in self.shards:
                if not shard.is_file():
                    raise OffloadError(f"missing checkpoint shard {shard}")
                if shard.suffix == ".safetensors":
                    self.entries.update(read_header(shard))
                    continue
                # mmap: bytes are paged in as tensors are touched, never the whole shard. A legacy
                # .bin (torch.save before torch 1.6, or _use_new_zipfile_serialization=False) is
                # no zip, which mmap needs: it is read whole.
                mmap = zipfile.is_zipfile(shard)
                try:
                    self.mapped.update(torch.load(shard, mmap=mmap, weights_only=True))
                except OSError:
                    raise  # unreadable: said below
                except Exception as err:  # an unpickler fails in many ways on what it cannot read
                    reason = one_line(err) if mmap else "no zip, nor a legacy torch.save of tensors"
                    raise OffloadError(f"corrupt checkpoint shard {shard}: {reason}") from None
        except OSError as err:  # unreadable (a hub cache file of mode 600 that is not ours)
            raise OffloadError(f"cannot read {err.filename or folder}: {err.strerror}") from None
        if not self.shards:
            raise OffloadError(f"no model.safetensors or pytorch_model.bin weights in {folder}")

    def name_as(self, model) -> None:
        """Serve tensors under `model`'s names where transformers renames them while loading.

        A mixture of experts is stored one matrix per expert (Mixtral's experts.3.w1.weight);
        transformers 5 holds one stacked tensor per projection (experts.gate_up_proj: experts x
        (gate; up) x hidden) and converts as it loads, by rules it keeps per family. We follow
        the same rules, one layer at a time: `tensor` builds a stacked tensor from its sources.
        """
        import transformers.core_model_loading as loading
        from transformers.conversion_mapping import get_model_conversion_mapping

        rules = get_model_conversion_mapping(model)
        converters = [rule for rule in rules if isinstance(rule, loading.WeightConverter)]
        renamings = [rule for rule in rules if not isinstance(rule, loading.WeightConverter)]
        # in natural order: expert 2 before expert 10
        for key in sorted([*self.entries, *self.mapped], key=loading.dot_natural_key):
            name, pattern = loading.rename_source_key(key, renamings, converters)
            if name != key:  # model name -> (its rule, [(stored name, the rule's pattern)])
                rule = next((c for c in converters if pattern in c.source_patterns), None)
                self.sources.setdefault(name, (rule, []))[1].append((key, pattern))

    def stored(self, name: str) -> torch.Tensor:
        """One tensor as the checkpoint stores it, on the host."""
        if name in self.mapped:
            return self.mapped[name]
        entry = self.entries[name]  # every name read was checked (check_weights, check_layers)
        found = torch.empty(entry.end - entry.start, dtype=torch.uint8)  # (nbytes,)
        with open(entry.path, "rb") as file:
            pread_into(file.fileno(), found, entry.start, entry.path)
        return found.view(entry.dtype).view(entry.shape)

    def convert(self, name: str, load) -> torch.Tensor:
        """Model tensor `name` built by its transformers rule from `load(stored name)` of each
        source (a rename only: the one source as it is)."""
        rule, sources = self.sources[name]
        if rule is None:
            return load(sources[0][0])
        rule = copy.deepcopy(rule)  # a rule collects the tensors it is given
        for key, pattern in sources:
            rule.add_tensor(name, key, pattern, partial(load, key))
        return rule.convert(name)[name]

    def names(self) -> set[str]:
        """The model's names for the stored tensors (a mixture's experts stacked: `name_as`)."""
        renamed = {key for _, sources in self.sources.values() for key, _ in sources}
        return (self.entries.keys() | self.mapped.keys()) - renamed | self.sources.keys()

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """Stored dtype and shape of one tensor."""
        if name in self.sources:  # built by a rule: its sources' dtype, its shape from meta ones
            found = self.convert(name, lambda key: torch.empty(self.spec(key)[1], device="meta"))
            return self.spec(self.sources[name][1][0][0])[0], tuple(found.shape)
        if (found := self.entries.get(name) or self.mapped.get(name)) is None:  # Entry or tensor
            raise OffloadError(f"{self.folder}: the checkpoint has no tensor {name}")
        return found.dtype, tuple(found.shape)

    def check_layers(self, model, kind: str | None = None) -> dict[str, tuple[int, ...]]:
        """What a decoder layer of `model` (a meta skeleton) holds, name -> shape, once every
        layer's tensors were found with those shapes and can be stored quantized as `kind` says
        (int4: whole groups of inputs); offload streams them from one slot."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            family = model.config.model_type
            raise OffloadError(f"{self.folder}: {family} has no decoder layers at model.layers")
        shapes = {name: tuple(p.shape) for name, p in layers[0].named_parameters()}
        every = {f"model.layers.{i}.{n}": s for i in range(len(layers)) for n, s in shapes.items()}
        for name, shape in every.items():
            if (found := self.spec(name)[1]) != shape:
                raise OffloadError(f"{self.folder}: {name} has shape {found}, config wants {shape}")
        try:  # quantize.py's arithmetic refuses with a ValueError; here it is a one-line error
            quantize.stored_layer(shapes, torch.float32, kind)
        except ValueError as err:
            raise OffloadError(str(err)) from None
        return shapes

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor on the host, in its stored dtype; the model's name (see `name_as`); its shape
        is the one check_weights found the model asks for.

        Checked finite as it is read: a NaN or inf weight would otherwise surface as non-finite
        logits of whatever computes with it first, a quantized copy as draft, say, which is then
        blamed for the checkpoint's fault. (Every tensor read here is read whole anyway: into
        memory, into RAM for the offloader, or into a converted copy.)"""
        found = self.convert(name, self.stored) if name in self.sources else self.stored(name)
        # A sum is NaN or inf iff an element is; in float64 no finite weight overflows it
        if found.is_floating_point() and not math.isfinite(found.sum(dtype=torch.float64)):
            raise OffloadError(
                f"{self.folder}: the checkpoint's {name} holds NaN or inf: its weights are broken"
            )
        return found

    @property
    def dtype(self) -> torch.dtype:
        """What its decoder layers are stored in ("the checkpoint's own dtype"): layer 0's first
        tensor's."""
        names = sorted(n for n in [*self.entries, *self.mapped] if n.startswith("model.layers.0."))
        if not names:
            raise OffloadError(f"{self.folder}: no decoder layers at model.layers to stream")
        return self.spec(names[0])[0]

    def layer(self, i, shapes) -> dict:
        """Decoder layer i's tensors, by their names inside the layer (`shapes`' keys), in their
        stored dtypes."""
        return {n: self.tensor(f"model.layers.{i}.{n}") for n in shapes}

    def layer_entries(self, i, shapes) -> dict:
        """Where the same tensors lie in the safetensors shards: an Entry each, None for one not
        stored so (a .bin, stacked experts)."""
        return {n: self.entries.get(f"model.layers.{i}.{n}") for n in shapes}

    def fingerprint(self) -> str:
        """Changes when the checkpoint's files do: an older offload folder is then not reused.

        The change time (ctime) too, not only the modification time: `touch -r`, `cp -p`,
        `rsync -a` and `tar x` restore a replaced file's mtime, but no user can set its ctime,
        which every write (and every such restore) moves on."""
        stats = zip(self.shards, map(os.stat, self.shards))
        stamps = [(shard.name, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for shard, s in stats]
        return hashlib.sha1(repr((str(self.folder.resolve()), stamps)).encode()).hexdigest()[:12]


# ---- every weight the model asks for, and nothing else ----

EMBEDDING = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


def ties_head(model: torch.nn.Module) -> bool:
    """Whether the LM head is the embedding (tie_word_embeddings), as the built model has it."""
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def check_weights(ckpt: Checkpoint, model: torch.nn.Module) -> None:
    """No weight missing, none the model has no place for, none of another shape.

    Hugging Face fills a missing weight with random numbers and runs; we refuse. A tied head
    needs no lm_head.weight; a stored one is accepted only if it equals the embedding, so that
    no reader can take the one for the other."""
    want = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    have = {name: ckpt.spec(name)[1] for name in ckpt.names()}
    if ties_head(model):
        want.pop(HEAD, None)  # a family of another name (config.json's model_type) has none
        if (head := have.pop(HEAD, None)) is not None and not (  # a stored head: the embedding?
            head == have.get(EMBEDDING) and torch.equal(ckpt.tensor(HEAD), ckpt.tensor(EMBEDDING))
        ):
            raise OffloadError(
                f"{ckpt.folder}: config.json ties lm_head to the embedding (tie_word_embeddings), "
                "but the checkpoint holds another lm_head.weight"
            )
    shapes = [f"{w} {have[w]} vs {want[w]}" for w in want.keys() & have if have[w] != want[w]]
    for bad, what in [
        (want.keys() - have.keys(), "lacks {n} weights its config.json asks for"),
        (have.keys() - want.keys(), "holds {n} weights its config.json has no place for"),
        (shapes, "has {n} weights of another shape than its config.json gives"),
    ]:
        if bad:  # the names at fault, the first of them named
            first = sorted(bad)[0] + (", ..." if len(bad) > 1 else "")
            raise OffloadError(f"{ckpt.folder}: the checkpoint {what.format(n=len(bad))} ({first})")


# ---- the ssd tier's files: the checkpoint's own, or a converted copy with one file per layer ----

# What a converted copy promises, written once and reused by later runs:
# - it is whole or absent: each file is written under a temporary name, then renamed
#   (`write_then_rename`), and the manifest (each file's size and SHA-256) goes last; a copy is
#   reused only where every file matches its manifest (`copy_damage`), else written again;
# - two processes never write one copy: one run at a time writes into or checks the copies in
#   offload_dir, under a lock on it (`locked`); a second run waits, then reuses the first's copy;
# - an interrupted copy leaves nothing: a failure, Ctrl-C or SIGTERM while it is written removes
#   its folder (`removed_if_unfinished`), and a copy the disk has no room for is refused before
#   its first byte (`write_copy`).


def ssd_layers(
    ckpt: Checkpoint, shapes: dict, n_layers: int, dtype, kind, offload_dir
) -> tuple[list[dict[str, Entry]], Path | None]:
    """Where the ssd tier reads each decoder layer's tensors (name -> Entry, a dict per layer):
    the checkpoint's own safetensors where they will do (`copy_folder` None); else a copy with one
    safetensors file per layer, in `dtype` or quantized (kind "int8" or "int4", as
    quantize.quantize_layer stores it), whose folder is returned too."""
    folder = copy_folder(ckpt, dtype, kind, offload_dir)  # "~/copies": in the home folder
    if folder is None:
        return [ckpt.layer_entries(i, shapes) for i in range(n_layers)], None
    manifest = {"source": str(ckpt.folder.resolve()), "layers": n_layers, "quantize": kind}
    manifest["dtype"] = str(dtype).removeprefix("torch.")
    files = [folder / f"layer_{i:03d}.safetensors" for i in range(n_layers)]
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with locked(folder.parent):
            damage = copy_damage(folder, manifest, files)
            if damage is not None:  # None: converted by an earlier run, and whole
                write_copy(ckpt, shapes, dtype, kind, folder, manifest, files, damage)
    except OSError as err:
        raise OffloadError(f"cannot write offload folder {folder}: {err.strerror or err}") from None
    return [read_header(path) for path in files], folder


def copy_folder(ckpt: Checkpoint, dtype, kind, offload_dir) -> Path | None:
    """Where `ssd_layers` writes (or finds) the copy of `ckpt` in `dtype`, quantized as `kind` says:
    named for the checkpoint's files as they are now (`fingerprint`), so a changed checkpoint
    gets a new copy. None where the ssd tier streams the checkpoint's own files: every decoder
    layer's tensor stored as the model names it (not stacked from a mixture's experts, not in a
    .bin), in `dtype`, at an offset a view of `dtype` can start at, and not to be quantized."""
    layers = [ckpt.entries.get(n) for n in ckpt.names() if n.startswith("model.layers.")]
    fits = all(e and e.dtype == dtype and e.start % dtype.itemsize == 0 for e in layers)
    if fits and kind is None:
        return None
    if offload_dir is None:
        raise OffloadError(f"{ckpt.folder} needs a one-time conversion for ssd; pass offload_dir")
    name = f"{ckpt.folder.name}-{ckpt.fingerprint()}-{copy_label(dtype, kind)}"
    return expanded(offload_dir) / name


def copy_label(dtype, kind) -> str:
    """int8-float16: int8 levels with float16 scales; float64: unquantized float64."""
    return (f"{kind}-" if kind else "") + str(dtype).removeprefix("torch.")


def check_offload_dir(offload_dir) -> None:
    """offload_dir, checked before anything is read: None (no copy can be written) or a path
    that is no file; "" is refused, not taken for the working directory."""
    path = isinstance(offload_dir, str | os.PathLike) and os.fspath(offload_dir).strip()
    if offload_dir is not None and not path:
        raise OffloadError(f"offload_dir must be a path (the copy's folder), not {offload_dir!r}")
    if path and expanded(offload_dir).is_file():
        raise OffloadError(f"cannot write offload folder {offload_dir}: it is a file, not a folder")


@contextmanager
def locked(folder: Path):
    """Hold an exclusive lock on `folder` (flock, released when its descriptor closes)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"offload: waiting for another run using {folder}", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def copy_damage(folder: Path, manifest: dict, files: list[Path]) -> str | None:
    """None if `folder` holds the finished copy `manifest` describes, else what is wrong ("" if
    it was never finished). Sizes first; then every file's SHA-256, read once at open: about one
    target pass of reading (the ssd tier reads the whole copy every pass), on all cores.

    A file of the copy that is there but cannot be read (its mode, its owner) is an OffloadError
    naming it: the ssd tier would have to read it every pass, and writing it again could not
    change who may read it."""
    try:
        written = json.loads((folder / "manifest.json").read_text())
        sizes, digests = zip(*(written["files"][file.name] for file in files))  # as written
        if {**manifest, "files": written["files"]} != written:
            return "its manifest.json describes another copy"
        for file, size in zip(files, sizes):
            if not file.is_file() or file.stat().st_size != size:
                return f"{file.name} is missing or not {size} bytes"
        with ThreadPoolExecutor() as pool:  # hashlib lets go of the GIL: one file per core
            for file, digest, found in zip(files, digests, pool.map(sha256, files)):
                if found != digest:
                    return f"{file.name} is not the file that was written"
    except FileNotFoundError:  # no manifest: never finished
        return ""
    except (ValueError, KeyError, TypeError):  # not JSON, or not a manifest of ours
        return "its manifest.json is not one this version wrote"
    except OSError as err:  # PermissionError, EIO: reading, not writing, failed
        raise OffloadError(
            f"cannot read the converted copy's {err.filename or folder} ({err.strerror or err}); "
            f"delete {folder} to have it written again"
        ) from None
    return None


def sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def write_copy(ckpt, shapes, dtype, kind, folder: Path, manifest: dict, files: list, damage: str):
    """Convert every layer into its file, then write the manifest. Announced on stderr (`damage`:
    what is wrong with the copy there, "" if there is none), and refused before the first byte
    where the disk has no room for it: a full disk would stop it part-way, after minutes."""
    from safetensors.torch import save

    stored = quantize.stored_layer(shapes, dtype, kind)  # meta: dtypes and shapes
    nbytes = len(files) * sum(t.nbytes for t in stored.values())
    size = f"{nbytes / 1e9:.2f} GB {copy_label(dtype, kind)}"
    # A damaged copy's files count as room, being replaced. 64 KiB: a header
    needed = nbytes + len(files) * 2**16
    held = sum(f.stat().st_size for f in folder.glob("*") if f.is_file())  # none: 0
    if needed > (free := shutil.disk_usage(folder.parent).free + held):
        raise OffloadError(
            f"the converted copy needs {needed / 1e9:.3g} GB, but {folder.parent} has "
            f"{free / 1e9:.3g} GB free: free space there or choose another --offload-dir"
        )
    say = f"the {size} copy in {folder} is damaged ({damage}); writing it again"
    if not damage:
        say = (
            f"writing a {size} per-layer copy of {ckpt.folder} into {folder} "
            "(reused next time; delete it to free the space)"
        )
    print(f"offload: {say}", file=sys.stderr)
    sums = {}  # file name -> [size, SHA-256], for the manifest
    with removed_if_unfinished(folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "manifest.json").unlink(missing_ok=True)  # unfinished until written again
        for i in tqdm(range(len(files)), desc=f"offload: converting layers into {folder}"):
            data = save(quantize.quantize_layer(ckpt.layer(i, shapes), dtype, kind))
            write_then_rename(files[i], data)
            sums[files[i].name] = [len(data), hashlib.sha256(data).hexdigest()]
        write_then_rename(folder / "manifest.json", json.dumps(manifest | {"files": sums}).encode())


@contextmanager
def removed_if_unfinished(folder: Path):
    """Remove `folder` if the block does not finish: a full disk, Ctrl-C, or SIGTERM (`kill`, a
    job scheduler's stop, a closing terminal's session), which meanwhile raises Terminated as
    Ctrl-C raises KeyboardInterrupt, and then still ends the process. SIGTERM is left alone
    where the program handles it itself, and outside the main thread (where Python cannot set
    a handler)."""
    main = threading.current_thread() is threading.main_thread()
    ours = main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    if ours:
        signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    except BaseException as err:  # what was written only takes space
        if ours:  # from here on SIGTERM ends the process again
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        shutil.rmtree(folder, ignore_errors=True)
        if isinstance(err, Terminated):  # end as SIGTERM ends a process, now that it is tidy
            os.kill(os.getpid(), signal.SIGTERM)
        raise
    if ours:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Terminated(BaseException):
    """SIGTERM, raised while a copy is being written (`removed_if_unfinished`)."""


def terminate(signum, frame):
    raise Terminated


def write_then_rename(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all; a failed write's temporary file goes with the copy's
    folder (`removed_if_unfinished`)."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())  # the rename must not reach the disk before the bytes do
    os.replace(temporary, path)  # atomic: the file is either absent or whole
