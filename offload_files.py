"""The checkpoint files offload.py reads: safetensors headers, .bin shards, the converted copy.

`Checkpoint` finds each tensor of a model folder (a byte range of a safetensors shard, or a tensor
memory-mapped from a .bin shard); `convert` writes the per-layer safetensors copy that the ssd
tier reads when the checkpoint's own files cannot be read as they are (another dtype, .bin).
"""

import fcntl
import hashlib
import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
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


def one_line(err: BaseException) -> str:
    """The whole message on one line (transformers puts the reason on a second one)."""
    return " ".join(str(err).split())[:300] or type(err).__name__


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


# Decoder-only families whose Hugging Face models take a 4D float mask as given (config.model_type).
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def load_configs(folder: Path):
    """The model's config, and its generation config (eos ids etc.) where the folder has one.

    The one place that decides which families are supported, for the CLI and the offloader."""
    from transformers import AutoConfig, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(folder)
        generation = None
        if (folder / "generation_config.json").is_file():
            generation = GenerationConfig.from_pretrained(folder)
    except Exception as err:  # transformers checks values as it reads them, with its own errors
        raise OffloadError(f"{folder}: cannot load its config ({one_line(err)})") from None
    if config.model_type not in SUPPORTED_FAMILIES:
        raise OffloadError(
            f"{folder}: model family {config.model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_FAMILIES)} (Llama, Mistral, Qwen2/3, SmolLM, TinyLlama)"
        )
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"):
        value = getattr(config, name, None)  # 0 or -1 layers build an empty model without a word
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OffloadError(f"{folder}: config.json gives {name} {value!r}, not a count >= 1")
    return config, generation


def skeleton(config, folder: Path) -> torch.nn.Module:
    """The model the config describes, on the meta device: its names, shapes and code, no bytes.

    An unknown activation or rope type only fails here, when transformers builds the model."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as err:
        raise OffloadError(f"{folder}: cannot build its model ({one_line(err)})") from None


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from itself or its name ("float16", "torch.bfloat16")."""
    if not isinstance(dtype, str):
        return dtype
    found = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise OffloadError(f"dtype {dtype!r} is no torch dtype; try 'float16' or 'bfloat16'")
    return found


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
        try:
            self.find_tensors(folder)
        except OSError as err:  # unreadable (a hub cache file of mode 600 that is not ours)
            raise OffloadError(f"cannot read {err.filename or folder}: {err.strerror}") from None

    def find_tensors(self, folder: Path) -> None:
        self.folder, self.shards = folder, []
        self.entries: dict[str, Entry] = {}  # safetensors: where each tensor's bytes are
        self.mapped: dict[str, torch.Tensor] = {}  # .bin: tensors memory-mapped by torch.load
        for weights in ("model.safetensors", "pytorch_model.bin"):
            index = folder / f"{weights}.index.json"
            if index.exists():
                try:  # "metadata" (the total size) is optional: the weight map is what we read
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

    @property
    def dtype(self) -> torch.dtype:
        """What its decoder layers are stored in: "the checkpoint's own dtype"."""
        return self.spec("model.layers.0.self_attn.q_proj.weight")[0]

    def names(self) -> set[str]:
        return self.entries.keys() | self.mapped.keys()

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

    def layer(self, i: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """Decoder layer i's tensors, by their names inside the layer, in their stored dtypes."""
        return {name: self.tensor(f"model.layers.{i}.{name}", s) for name, s in shapes.items()}

    def fingerprint(self) -> str:
        """Changes when the checkpoint's files do: an older offload folder is then not reused."""
        stamps = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in self.shards]
        return hashlib.sha1(repr((str(self.folder.resolve()), stamps)).encode()).hexdigest()[:12]


# ---- one check and one load of a model folder, in memory or offloaded ----

EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def open_checkpoint(folder: Path, config) -> tuple[Checkpoint, torch.nn.Module]:
    """The checkpoint, and the model its config describes (on meta), checked to fill it exactly.

    The one check of a folder's weights, whether the model then runs in memory (cli.load_model)
    or offloaded (offload.from_pretrained): a folder is refused by both tiers or by neither."""
    ckpt, model = Checkpoint(folder), skeleton(config, folder)
    check_weights(ckpt, model)
    return ckpt, model


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
        del want[HEAD]
        if HEAD in have and not (
            have[HEAD] == have.get(EMBEDDING)
            and torch.equal(ckpt.tensor(HEAD, have[HEAD]), ckpt.tensor(EMBEDDING, have[HEAD]))
        ):
            raise OffloadError(
                f"{ckpt.folder}: config.json ties lm_head to the embedding (tie_word_embeddings), "
                "but the checkpoint holds another lm_head.weight"
            )
        have.pop(HEAD, None)
    common = sorted(want.keys() & have.keys())
    for names, what in [
        (want.keys() - have.keys(), "lacks {n} weights its config.json asks for"),
        (have.keys() - want.keys(), "holds {n} weights its config.json has no place for"),
        (
            [f"{name} {have[name]} vs {want[name]}" for name in common if have[name] != want[name]],
            "has {n} weights of another shape than its config.json gives",
        ),
    ]:
        if names:
            first = sorted(names)[0] + (", ..." if len(names) > 1 else "")
            raise OffloadError(
                f"{ckpt.folder}: the checkpoint {what.format(n=len(names))} ({first})"
            )


def load_weights(ckpt: Checkpoint, model, device, dtype, generation, layers=True) -> None:
    """Give `model` (checked by open_checkpoint) the checkpoint's tensors on `device` in `dtype`:
    all of them, or with layers=False all but the decoder layers' (offload.py streams those)."""
    tied = ties_head(model)
    tensors = {
        name: ckpt.tensor(name, param.shape).to(device=device, dtype=dtype)
        for name, param in model.named_parameters()  # a tied head is listed once, as EMBEDDING
        if layers or not name.startswith("model.layers.")
    }
    model.load_state_dict(tensors, strict=False, assign=True)
    if tied:  # the head still holds the embedding's meta tensor: tie it to the new one
        model.lm_head.weight = model.model.embed_tokens.weight
    # rotary frequencies are computed, not stored: build them again, off the meta device
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config).to(device)
    if generation is not None:
        model.generation_config = generation
    model.requires_grad_(False).eval()


# ---- the converted copy: one safetensors file per layer ----


def convert(ckpt: Checkpoint, shapes: dict, n_layers: int, dtype, offload_dir, kind=None) -> Path:
    """Write one safetensors file per layer, in `dtype` or quantized (kind "int8" or "int4", as
    quantize.quantize_layer stores it), once; later runs check the folder and reuse it.

    The manifest goes last and records each file's size and SHA-256: a folder left by a failed
    run (disk full, killed) is never taken for a finished one, and a copy damaged since (bytes
    zeroed, files swapped) is written again. One run at a time writes into or checks a copy in
    offload_dir (a lock on it): a second run waits, then reuses what the first wrote.
    """
    import quantize  # here: quantize.py imports this module's OffloadError

    if offload_dir is None:
        raise OffloadError(f"{ckpt.folder} needs a one-time conversion for ssd; pass offload_dir")
    dtype_name = str(dtype).removeprefix("torch.")
    label = f"{kind}-{dtype_name}" if kind else dtype_name  # int8-float16: int8 with fp16 scales
    folder = Path(offload_dir) / f"{ckpt.folder.name}-{ckpt.fingerprint()}-{label}"
    manifest = {"source": str(ckpt.folder.resolve()), "dtype": dtype_name, "layers": n_layers}
    manifest["quantize"] = kind
    files = [folder / f"layer_{i:03d}.safetensors" for i in range(n_layers)]
    try:
        Path(offload_dir).mkdir(parents=True, exist_ok=True)
        with locked(Path(offload_dir)):
            damage = copy_damage(folder, manifest, files)
            if damage is None:
                return folder  # converted by an earlier run
            stored = quantize.stored_layer(shapes, dtype, kind)  # meta; fails now if it cannot be
            size = f"{len(files) * sum(t.nbytes for t in stored.values()) / 1e9:.2f} GB {label}"
            if damage:
                say = f"the {size} copy in {folder} is damaged ({damage}); writing it again"
            else:
                say = (
                    f"writing a {size} per-layer copy of {ckpt.folder} into {folder} "
                    "(reused next time; delete it to free the space)"
                )
            print(f"offload: {say}", file=sys.stderr)
            write_copy(ckpt, shapes, dtype, kind, folder, manifest, files)
    except OSError as err:
        raise OffloadError(f"cannot write offload folder {folder}: {err.strerror or err}") from None
    return folder


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
    target pass of reading (the ssd tier reads the whole copy every pass), on all cores."""
    try:
        written = json.loads((folder / "manifest.json").read_text())
        sizes, digests = zip(*(written["files"][file.name] for file in files))  # as written
        if {**manifest, "files": written["files"]} != written:
            return "its manifest.json describes another copy"
    except FileNotFoundError:
        return ""
    except (OSError, ValueError, KeyError, TypeError):
        return "its manifest.json is not one this version wrote"
    for file, size in zip(files, sizes):
        if not file.is_file() or file.stat().st_size != size:
            return f"{file.name} is missing or not {size} bytes"
    with ThreadPoolExecutor() as pool:  # hashlib lets go of the GIL: one file per core
        for file, digest, found in zip(files, digests, pool.map(sha256, files)):
            if found != digest:
                return f"{file.name} is not the file that was written"
    return None


def sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def write_copy(ckpt, shapes, dtype, kind, folder: Path, manifest: dict, files: list[Path]):
    """Convert every layer into its file, then write the manifest; on any failure remove them."""
    from safetensors.torch import save

    import quantize

    sums = {}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "manifest.json").unlink(missing_ok=True)  # unfinished until written again
        for i in tqdm(range(len(files)), desc=f"offload: converting layers into {folder}"):
            data = save(quantize.quantize_layer(ckpt.layer(i, shapes), dtype, kind))
            write_then_rename(files[i], data)
            sums[files[i].name] = [len(data), hashlib.sha256(data).hexdigest()]
        write_then_rename(
            folder / "manifest.json", json.dumps({**manifest, "files": sums}).encode()
        )
    except BaseException:  # a full disk, Ctrl-C: what was written is of no use, only takes space
        shutil.rmtree(folder, ignore_errors=True)
        raise


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
