"""The checkpoint files offload.py reads: safetensors headers, .bin shards, the converted copy.

`Checkpoint` finds each tensor of a model folder (a byte range of a safetensors shard, or a tensor
memory-mapped from a .bin shard); `convert` writes the per-layer safetensors copy that the ssd
tier reads when the checkpoint's own files cannot be read as they are (another dtype, .bin).
Beside them, the checks of what a user asks for before any weight is read: the model family
(`load_configs`), the dtype (`as_dtype`) and whether the device can run it (`check_dtype_runs`).
"""

import copy
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm


class OffloadError(ValueError):
    """Bad input to the offloader: a one-line message that says what and where."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file, as the file's header describes it."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


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


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def open_direct(path: Path) -> int:
    """A file descriptor that reads with O_DIRECT where the filesystem allows it (tmpfs doesn't).

    O_DIRECT lets the disk write straight into our buffer. A buffered read costs a copy out of the
    page cache, measured here at ~0.7 CPU-seconds per GB: CPU time the layer's compute needs.
    """
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return os.open(path, os.O_RDONLY)


def find_folder(name_or_path: str) -> Path:
    if Path(name_or_path).expanduser().is_dir():
        return Path(name_or_path).expanduser()
    from huggingface_hub import snapshot_download

    try:  # safetensors where the repo has them, .bin only where it has not
        folder = Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"]))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.bin"]))
    except Exception as err:  # what the hub raises varies with the failure and the version
        raise OffloadError(
            f"{name_or_path} is no folder and no reachable hub id: {first_line(err)}"
        ) from None
    return folder


def load_configs(folder: Path):
    """The model's config, and its generation config (eos ids etc.) where the folder has one.

    The one place that decides which models are supported, for the CLI and the offloader: a
    causal LM of transformers whose layers a tree pass can run, as `specexec.listen_to_layers`
    checks on the model itself (attention that takes a 4D mask, a cache of keys and values)."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import specexec

    try:
        config = AutoConfig.from_pretrained(folder)
        generation = None
        if (folder / "generation_config.json").is_file():
            generation = GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as err:
        raise OffloadError(f"{folder}: cannot load its config ({first_line(err)})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise OffloadError(f"{folder}: {config.model_type!r} is no causal LM of transformers")
    try:
        specexec.listen_to_layers(config)
    except specexec.SpecExecError as err:
        raise OffloadError(f"{folder}: {err}") from None
    return config, generation


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from itself or its name ("float16", "torch.bfloat16")."""
    if not isinstance(dtype, str):
        return dtype
    found = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise OffloadError(f"dtype {dtype!r} is no torch dtype; try 'float16' or 'bfloat16'")
    return found


def check_dtype_runs(device: torch.device, dtype: torch.dtype) -> None:
    """Fail now, not mid-generation, if the device cannot run a matmul and softmax in `dtype`."""
    old_gpu = device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False)
    if dtype == torch.bfloat16 and old_gpu:  # emulated bfloat16 runs, slowly
        raise OffloadError(f"{device} has no native bfloat16; pass dtype=torch.float16")
    try:
        x = torch.ones(2, 8, dtype=dtype, device=device)  # (2, 8)
        torch.softmax(x @ x.T, dim=-1)
    except (RuntimeError, NotImplementedError, TypeError) as err:
        reason = first_line(err)
        raise OffloadError(f"{device} cannot run {dtype} ({reason}); pass another dtype") from None


DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DTYPES |= {"I8": torch.int8, "U8": torch.uint8}  # quantized levels (quantize.py)


def read_header(path: Path) -> dict[str, Entry]:
    """Parse a safetensors header (8-byte little-endian length + JSON); check the file is whole."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if size < 8 or 8 + length > size:
            raise OffloadError(f"truncated safetensors shard {path}: header runs past the end")
        try:
            header = json.loads(file.read(length))
            header.pop("__metadata__", None)
            infos = {
                name: (info["dtype"], info["data_offsets"], info["shape"])
                for name, info in header.items()
            }
        except (ValueError, KeyError, TypeError, AttributeError):
            raise OffloadError(f"corrupt safetensors shard {path}: header is not one") from None
    entries = {}
    for name, (dtype, (start, end), shape) in infos.items():
        if dtype not in DTYPES:
            raise OffloadError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        entries[name] = Entry(
            path, DTYPES[dtype], tuple(shape), 8 + length + start, 8 + length + end
        )
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
        self.sources: dict[str, tuple] = {}  # model name -> how it is built (`name_as`)
        for weights in ("model.safetensors", "pytorch_model.bin"):
            index = folder / f"{weights}.index.json"
            if index.exists():
                try:
                    files = json.loads(index.read_text())["weight_map"].values()
                except (ValueError, KeyError, TypeError, AttributeError):
                    raise OffloadError(f"corrupt checkpoint index {index}") from None
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

    def name_as(self, model) -> None:
        """Serve tensors under `model`'s names where transformers renames them while loading.

        A mixture of experts is stored one matrix per expert (Mixtral's experts.3.w1.weight);
        transformers 5 holds one stacked tensor per projection (experts.gate_up_proj: experts x
        (gate; up) x hidden) and converts as it loads, by rules it keeps per family. We follow
        the same rules, one layer at a time: `tensor` builds a stacked tensor from its sources.
        """
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            dot_natural_key,
            rename_source_key,
        )

        rules = get_model_conversion_mapping(model)
        converters = [rule for rule in rules if isinstance(rule, WeightConverter)]
        renamings = [rule for rule in rules if not isinstance(rule, WeightConverter)]
        for key in sorted([*self.entries, *self.mapped], key=dot_natural_key):  # expert 2 < 10
            name, pattern = rename_source_key(key, renamings, converters)
            if name != key:  # model name -> (its rule, [(stored name, the rule's pattern)])
                rule = next((c for c in converters if pattern in c.source_patterns), None)
                self.sources.setdefault(name, (rule, []))[1].append((key, pattern))

    def stored(self, name: str) -> torch.Tensor:
        """One tensor as the checkpoint stores it, on the host."""
        if name in self.mapped:
            return self.mapped[name]
        if name not in self.entries:
            raise OffloadError(f"{self.folder}: the checkpoint has no tensor {name}")
        entry = self.entries[name]
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

    def spec(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """Stored dtype and shape of one tensor."""
        if name in self.sources:  # built by a rule: its sources' dtype, its shape from meta ones
            first_source = self.sources[name][1][0][0]
            found = self.convert(name, lambda key: torch.empty(self.spec(key)[1], device="meta"))
            return self.spec(first_source)[0], tuple(found.shape)
        if name in self.entries:
            return self.entries[name].dtype, self.entries[name].shape
        if name in self.mapped:
            return self.mapped[name].dtype, tuple(self.mapped[name].shape)
        raise OffloadError(f"{self.folder}: the checkpoint has no tensor {name}")

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        if (found := self.spec(name)[1]) != tuple(shape):
            raise OffloadError(f"{self.folder}: {name} has shape {found}, config wants {shape}")

    def check_layers(self, model) -> dict[str, tuple[int, ...]]:
        """What a decoder layer of `model` (a meta skeleton) holds, name -> shape, once every
        layer's tensors were found with those shapes; offload streams them from one slot."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            family = model.config.model_type
            raise OffloadError(f"{self.folder}: {family} has no decoder layers at model.layers")
        self.name_as(model)  # a mixture's experts: stored one by one, stacked in the model
        shapes = {name: tuple(p.shape) for name, p in layers[0].named_parameters()}
        for i in range(len(layers)):
            for name, shape in shapes.items():
                self.check(f"model.layers.{i}.{name}", shape)
        return shapes

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """One tensor on the host, in its stored dtype; the model's name (see `name_as`)."""
        self.check(name, tuple(shape))
        return self.convert(name, self.stored) if name in self.sources else self.stored(name)

    def layer_dtype(self) -> torch.dtype:
        """The dtype decoder layer 0 is stored in: that of its first tensor."""
        names = sorted(n for n in [*self.entries, *self.mapped] if n.startswith("model.layers.0."))
        if not names:
            raise OffloadError(f"{self.folder}: no decoder layers at model.layers to stream")
        return self.spec(names[0])[0]

    def layer(self, i: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """Decoder layer i's tensors, by their names inside the layer, in their stored dtypes."""
        return {name: self.tensor(f"model.layers.{i}.{name}", s) for name, s in shapes.items()}

    def fingerprint(self) -> str:
        """Changes when the checkpoint's files do: an older offload folder is then not reused."""
        stamps = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in self.shards]
        return hashlib.sha1(repr((str(self.folder.resolve()), stamps)).encode()).hexdigest()[:12]


def convert(ckpt: Checkpoint, shapes: dict, n_layers: int, dtype, offload_dir, kind=None) -> Path:
    """Write one safetensors file per layer, in `dtype` or quantized (kind "int8" or "int4", as
    quantize.quantize_layer stores it), once; later runs reuse the folder.

    Every file is written under a temporary name, then renamed, and the manifest goes last: a
    folder left by a failed run (disk full, killed) is never taken for a finished one.
    """
    from safetensors.torch import save

    import quantize  # here: quantize.py imports this module's OffloadError

    if offload_dir is None:
        raise OffloadError(f"{ckpt.folder} needs a one-time conversion for ssd; pass offload_dir")
    dtype_name = str(dtype).removeprefix("torch.")
    label = f"{kind}-{dtype_name}" if kind else dtype_name  # int8-float16: int8 with fp16 scales
    folder = Path(offload_dir).expanduser() / f"{ckpt.folder.name}-{ckpt.fingerprint()}-{label}"
    manifest = {"source": str(ckpt.folder.resolve()), "dtype": dtype_name, "layers": n_layers}
    manifest["quantize"] = kind
    done, files = (
        folder / "manifest.json",
        [folder / f"layer_{i:03d}.safetensors" for i in range(n_layers)],
    )
    try:  # a manifest that is not JSON, or a layer file lost since: converted again
        if json.loads(done.read_text()) == manifest and all(file.is_file() for file in files):
            return folder  # converted by an earlier run
    except (OSError, ValueError):
        pass
    stored = quantize.stored_layer(shapes, dtype, kind)  # meta; fails now if it cannot be
    nbytes = n_layers * sum(tensor.nbytes for tensor in stored.values())
    print(
        f"offload: writing a {nbytes / 1e9:.2f} GB {label} per-layer copy of {ckpt.folder} "
        f"into {folder} (reused next time; delete it to free the space)",
        file=sys.stderr,
    )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for i in tqdm(range(n_layers), desc=f"offload: converting layers into {folder}"):
            tensors = quantize.quantize_layer(ckpt.layer(i, shapes), dtype, kind)
            write_then_rename(files[i], save(tensors))
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
