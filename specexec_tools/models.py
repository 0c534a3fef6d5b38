"""From a model folder to a checked model: find it, open it once, check the pair and the prompt,
load it. The one path of the CLI, `specexec.generate` and `offload.from_pretrained`.

    find_folder(name)        a local folder, or a hub id's snapshot
    open_model(folder)       -> Opened: config and generation config read once, the checkpoint's
                             headers read once and checked to fill the model exactly, each
                             layer's attention window heard once (refuses what a tree cannot run)
    preflight(target, draft, input_ids)
                             the pair and the prompt: vocabularies, tokenizers, context, EOS;
                             before any weight loads (CLI) or any pass runs (generate)
    load(opened, device, dtype)
                             the model in memory; offload.from_pretrained streams it instead,
                             from the same Opened

Every refusal is one line naming the input: `SpecExecError` for what a user asks of a run,
`OffloadError` for a model folder (both in specexec_tools/__init__.py).
"""

import copy
import math
import numbers
import os
import time
import weakref
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

from specexec_tools import OffloadError, SpecExecError, UnsupportedModel, local_folder, one_line
from specexec_tools.checkpoint import Checkpoint, check_weights, ties_head
from specexec_tools.cost_model import weights

# How a model is handed its KV cache: transformers 5.24 renamed the forward's `past_key_values`
# to `cache` (the old name warns on stderr, and goes in 5.40). Every call passes `**{CACHE: c}`.
CACHE = (
    "cache" if [*map(int, version("transformers").split(".")[:2])] >= [5, 24] else "past_key_values"
)


# ---- finding and opening a model folder ----


def find_folder(name: str) -> Path:
    """A local model folder: the folder given, or a hub id's snapshot (cached, else downloaded:
    config, tokenizer and weights, .bin only where a repo has no safetensors). The one finder of
    the CLI's models and the offloader's; what it cannot find is one line naming `name`."""
    if (folder := local_folder(name)) is not None:
        return folder
    from huggingface_hub import constants, snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt"]  # config, weights, tokenizer
    with suppress(OSError, ValueError):  # not in the cache
        return Path(snapshot_download(name, allow_patterns=patterns, local_files_only=True))
    # The hub client retries a dead network for half a minute; one quick look decides instead.
    if offline := "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else unreachable(constants):
        raise OffloadError(
            f"{name}: no such folder, not in the Hugging Face cache, and {offline}; "
            "pass a local model folder (or download it once online; HF_HUB_OFFLINE=1 then "
            "uses the cache only)"
        )
    try:
        folder = Path(snapshot_download(name, allow_patterns=patterns))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(name, allow_patterns=[*patterns, "*.bin"]))
    except Exception as err:  # what the hub raises varies with the failure and the version
        raise OffloadError(f"{name}: cannot download it ({one_line(err)})") from None
    return folder


def unreachable(constants) -> str | None:
    """Why the hub (at huggingface_hub's `constants.ENDPOINT`) cannot be reached, or None."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    url = urlsplit(constants.ENDPOINT)
    try:
        if url.scheme not in urllib.request.getproxies():  # through a proxy: let the client try
            port = url.port or (443 if url.scheme == "https" else 80)
            socket.create_connection((url.hostname, port), timeout=5).close()
    except OSError as err:
        return f"{url.hostname} cannot be reached ({err.strerror or err})"
    return None


@dataclass
class Opened:
    """A model folder, checked. What runs it next (in memory, offloaded, the target's own
    quantized copy as draft) reads from here and opens nothing again."""

    folder: Path
    config: object  # transformers' PretrainedConfig
    generation_config: object | None  # its generation_config.json (EOS ids), where it has one
    checkpoint: Checkpoint  # where each tensor's bytes are; shapes checked against the config


def open_model(name) -> Opened:
    """A model folder or hub id, opened and checked once, before any weight is read: a causal LM
    of transformers whose layers a tree pass can run (`listen_to_layers`: attention that takes a
    4D mask, a cache of keys and values), whose checkpoint holds every weight its config asks
    for, with its shape, and nothing else. An Opened passes through unchanged."""
    if isinstance(name, Opened):
        return name
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder = find_folder(str(name))
    try:
        config = AutoConfig.from_pretrained(folder)
        generation = None
        if (folder / "generation_config.json").is_file():
            generation = GenerationConfig.from_pretrained(folder)
    except Exception as err:  # transformers checks values as it reads them, with its own errors
        raise OffloadError(f"{folder}: cannot load its config ({one_line(err)})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise OffloadError(f"{folder}: {config.model_type!r} is no causal LM of transformers")
    for count in ("vocab_size", "hidden_size", "num_hidden_layers"):
        check_count(config, count, folder)  # 0 or -1 layers build an empty model without a word
    check_numbers(config.to_dict(), folder)
    checkpoint = Checkpoint(folder)  # its headers, before a model of the config is built
    check_layer_count(config, checkpoint, folder)
    model = skeleton(config, folder)  # an unknown activation or rope type: its own error
    try:  # heard once: every model built from this config hears so (attention_windows)
        attention_windows(model)
    except SpecExecError as err:  # not supported, or config.json is broken
        raise OffloadError(f"{folder}: {err}") from None
    check_count(config, "max_position_embeddings", folder)  # the context (preflight's limit)
    checkpoint.name_as(model)  # a mixture's experts: stored one by one, stacked in the model
    check_weights(checkpoint, model)
    return Opened(folder, config, generation, checkpoint)


def check_count(config, name: str, folder: Path) -> None:
    value = getattr(config, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OffloadError(f"{folder}: config.json gives {name} {value!r}, not a count >= 1")


def check_numbers(fields: dict, folder: Path) -> None:
    """Every number of config.json (nested ones too) finite, and every norm's epsilon at least 0:
    a NaN epsilon makes every pass NaN, and so does a negative one (the root of a variance below
    it), found only once a run (and an ssd copy's conversion) got that far."""
    for name, value in fields.items():
        if isinstance(value, dict):
            check_numbers(value, folder)
        elif isinstance(value, float) and not math.isfinite(value):
            raise OffloadError(f"{folder}: config.json gives {name} {value}, not a finite number")
        elif isinstance(value, float) and name.endswith(("_eps", "epsilon")) and value < 0:
            raise OffloadError(f"{folder}: config.json gives {name} {value}, not an epsilon >= 0")


def check_layer_count(config, checkpoint: Checkpoint, folder: Path) -> None:
    """No more decoder layers than the checkpoint has: a tensor's first number in its name is
    its layer's. Checked before the model is built, which for 10**9 layers took minutes (a count
    below the checkpoint's is refused by check_weights: weights with no place)."""
    names = checkpoint.entries.keys() | checkpoint.mapped.keys()
    numbers = [next((int(p) for p in name.split(".") if p.isdigit()), -1) for name in names]
    if config.num_hidden_layers > (stored := max(numbers, default=-1) + 1):
        raise OffloadError(
            f"{folder}: config.json gives num_hidden_layers {config.num_hidden_layers}, but the "
            f"checkpoint holds {stored} decoder layers"
        )


def skeleton(config, folder: Path, dtype=None) -> torch.nn.Module:
    """The model the config describes, on the meta device: its names, shapes and code, no bytes.

    An unknown activation or rope type only fails here, when transformers builds the model;
    what torch warns of on meta (a zero-sized weight, say) is left to the checks that follow."""
    from transformers import AutoModelForCausalLM

    try:
        with quiet(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as err:
        raise OffloadError(f"{folder}: cannot build its model ({one_line(err)})") from None
    if dtype == torch.float64 and "grouped_mm" in model.get_experts_implementation().values():
        model.set_experts_implementation("eager")  # a mixture's default kernel lacks float64
    return model


# ---- how a pass runs: its attention kernels; a step's clock and threads ----

# The attention kernels a pass may use (specexec.decode_loop): all of torch's but cuDNN's, which
# plans a graph for each new shape of query, keys and mask, and here every pass's shape is new
# (the tree, the cache's length). On an H100 a float16 draft got it: 60 ms a pass, 3 ms for a
# shape planned. On a CPU the list changes nothing.
ATTENTION_KERNELS = [k for name, k in SDPBackend.__members__.items() if "CUDNN" not in name]
ATTENTION_KERNELS.remove(SDPBackend.ERROR)


TORCH_THREADS = torch.get_num_threads()  # torch's own count, as specexec found it


def use_threads(threads):
    """Set the CPU threads of a run's target passes (Options.threads): as given; 0: as set; None:
    one per core that other programs leave free (the command line's default), unless the caller
    chose torch's count (OMP_NUM_THREADS or MKL_NUM_THREADS, or torch.set_num_threads to another
    count than torch's own). Torch's own, one per core, collapses when another program holds a
    core: its threads wait for each other at every step (docs/results.md)."""
    chosen = {"OMP_NUM_THREADS", "MKL_NUM_THREADS"} & set(os.environ)
    if threads is None and not chosen and torch.get_num_threads() == TORCH_THREADS:
        threads = free_cores()
    if threads:
        torch.set_num_threads(threads)


def free_cores():
    """One thread per core that other programs leave free (the load average of the last
    minute), at least one."""
    cores = os.cpu_count() or 1
    return max(1, min(cores, round(cores - os.getloadavg()[0])))


def draft_threads(opts, draft):
    """The draft's CPU threads: as given; by default one for a small draft, whose pass is a few
    small matmuls that more threads only slow down on a busy CPU (they wait for each other:
    docs/results.md), and torch's setting (0) for a big one (a real model's layers, the target's
    own int4 copy)."""
    if opts.draft_threads is not None:
        return opts.draft_threads
    return 1 if weights(draft) < 50e6 else 0


class Clock:
    """Where a step's seconds go (specexec.speculative_step), set once for a run: its draft phase
    (the tree), on the draft's CPU threads where it drafts (draft_threads, above), its target
    phase (the pass and acceptance), each until its device's work is done (on a GPU, its queue),
    and the whole step from its draft phase on."""

    def __init__(self, target, draft, opts):
        self.target_device = torch.device(target.device)
        self.draft_device = torch.device("cpu" if draft is None else draft.device)
        self.draft_threads = None if draft is None else draft_threads(opts, draft)
        self.seconds = {}  # the step's phases: draft_s, target_s

    def draft(self, budget):
        """The step's first phase: its clock starts here (a plain step keeps the threads)."""
        self.start = time.perf_counter()
        return self.phase("draft_s", self.draft_device, self.draft_threads if budget else None)

    def target(self):
        return self.phase("target_s", self.target_device)

    @contextmanager
    def phase(self, name, device, threads=None):
        before = torch.get_num_threads()
        if threads and device.type == "cpu":  # 0 or None: as set
            torch.set_num_threads(threads)
        try:
            synchronize(device)
            start = time.perf_counter()
            yield
            synchronize(device)
            self.seconds[name] = time.perf_counter() - start
        finally:
            torch.set_num_threads(before)

    def step_seconds(self):
        """The step's phases, and all of it until now (draft_s, target_s, total_s)."""
        return self.seconds | {"total_s": time.perf_counter() - self.start}


def synchronize(device):
    """Wait for the work queued on a GPU (a CPU's is done when its call returns)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# ---- how far back each layer looks: heard from the layers themselves ----

_windows = {}  # id(config) -> (a weak reference to the config, attention_windows of it)


def attention_windows(model):
    """How far back each decoder layer looks: {None: window} when all layers share one, else
    {layer type: window} (the keys of `config.layer_types`); window None = the whole prefix.

    A tree needs the mask each layer would build for itself, and what a layer does is decided
    by its code, not by the config's fields: a Llama config may carry `sliding_window`, which
    Llama never applies. So we ask the layers (`listen_to_layers`), once per config: a model
    loaded from an Opened folder (in memory or offloaded) has its config's answer already."""
    config = model.config
    # never heard, or another config since at this id
    if (known := _windows.get(id(config))) is None or known[0]() is not config:
        _windows[id(config)] = weakref.ref(config), listen_to_layers(config)
    return _windows[id(config)][1]


def listen_to_layers(config):
    """`attention_windows`, heard from a model built from `config` on the meta device.

    Each attention layer hands its window to the attention function (kernels such as
    flash-attention slide by it; sdpa and eager slide by the mask the model builds from the same
    setting). We build the model from its config on the meta device (no memory, no compute), run
    one token through it with an attention function that only listens, and read what every layer
    passed. The same run checks that every layer is attention that takes our 4D mask as given;
    one that is not (a recurrent state, which cannot be rolled back to the accepted path) is
    refused in one line."""
    from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache

    family = config.model_type
    n_layers = config.num_hidden_layers
    given = torch.zeros(1, 1, 1, 1, device="meta")  # (1, 1, 1, 1): the 4D mask we pass
    heard = {}  # layer index -> (the window it passes, whether it got our mask)

    def listen(module, query, key, value, attention_mask, sliding_window=None, **kwargs):
        heard[module.layer_idx] = (sliding_window, attention_mask is given)
        batch, heads, n, _ = query.shape  # what attention returns: (batch, n, heads, v_dim)
        return query.new_zeros(batch, n, heads, value.shape[-1]), None

    AttentionInterface.register("specexec_listen", listen)
    config = copy.deepcopy(config)  # from_config keeps the config it is given, and edits it
    try:
        with quiet():  # what transformers says of a probe on meta is no news to a user
            # The cache transformers builds for it says what each layer keeps: a step keeps the
            # accepted path by gathering its keys and values, which a recurrent state (Mamba,
            # linear attention) or a compressed one does not hold. Built on the host, not on meta:
            # there a config it cannot be built for (a null sliding_window) fails, as in a run.
            for layer, kept in enumerate(DynamicCache(config=config).layers):
                if type(kept).__name__ not in ("DynamicLayer", "DynamicSlidingWindowLayer"):
                    raise UnsupportedModel(
                        f"{family} is not supported: layer {layer} keeps a {type(kept).__name__}, "
                        "not only keys and values: a tree's accepted path cannot be kept"
                    )
            with torch.device("meta"):  # batched_mm: a mixture's experts as they run on meta
                model = AutoModelForCausalLM.from_config(
                    config, experts_implementation="batched_mm"
                )
                model.config._attn_implementation = "specexec_listen"
                one = torch.zeros(1, 1, dtype=torch.long)  # (1, 1)
                model(one, attention_mask=given, position_ids=one, **{CACHE: DynamicCache()})
    except UnsupportedModel:
        raise
    except Exception as error:  # what a family raises on meta tensors or a plain cache varies
        if broken := config_fault(config):  # the family runs trees; this config of it runs nothing
            raise SpecExecError(f"config.json is broken: {broken}") from None
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UnsupportedModel(f"{family} is not supported: a tree pass fails ({reason})") from None
    for layer in range(n_layers):
        window, takes_mask = heard.get(layer, (None, None))
        if takes_mask is None:
            raise UnsupportedModel(
                f"{family} is not supported: layer {layer} does not attend through "
                "transformers' attention functions, so its tree mask cannot be checked"
            )
        if not takes_mask:
            raise UnsupportedModel(f"{family} is not supported: its attention ignores a 4D mask")
        if window is not None and window < 1:
            raise UnsupportedModel(
                f"{family}: a sliding window of {window} lets a token see nothing"
            )
    windows = [heard[layer][0] for layer in range(n_layers)]  # None: no window
    if len(set(windows)) < 2:
        return {None: next(iter(windows), None)}
    # Layers that differ pick their mask from a dict by layer type (Gemma 2, Qwen2, SmolLM3)
    kinds = getattr(config, "layer_types", None) or []
    by_kind = dict(zip(kinds, windows))
    if [by_kind.get(kind) for kind in kinds] != windows or len(kinds) != n_layers:
        raise UnsupportedModel(f"{family} is not supported: its layers' windows differ by no type")
    return by_kind


def config_fault(config) -> str | None:
    """What makes a config of a supported family unrunnable, in words naming its field, or None.
    Asked only once a pass on it failed: what transformers accepts as it reads a config, and
    then fails on deep in a pass, would otherwise read as a family we do not support."""
    fields = config.attribute_map  # the names a config answers to -> the field it stores
    experts = {fields.get(n, n) for n in ("num_local_experts", "num_experts", "n_routed_experts")}
    for name in sorted(n for n in experts if getattr(config, n, None) is not None):  # those set
        count = getattr(config, name)
        per_token = getattr(config, "num_experts_per_tok", None)
        if isinstance(count, bool) or not isinstance(count, int):
            return f"{name} is {count!r}, not a count"
        if count < 1:
            return f"{name} is {count}: a mixture of no experts"
        if isinstance(per_token, int) and per_token > count:
            return f"num_experts_per_tok is {per_token}, more than its {name} ({count})"
        if isinstance(per_token, int) and per_token < 1:
            return f"num_experts_per_tok is {per_token}: no expert for a token"
    sliding = [kind for kind in getattr(config, "layer_types", None) or [] if "sliding" in kind]
    if sliding and getattr(config, "sliding_window", 0) is None:
        return f"sliding_window is null, yet layer_types has {min(sliding)} layers"
    return None


@contextmanager
def quiet():
    """transformers' logging and Python's warnings held back: what a run of ours on the meta
    device makes transformers say (a recurrent family's kernels, say) is not about the user's
    model, and would print before the one line that refuses it."""
    import warnings

    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings(action="ignore"):
            yield
    finally:
        logging.set_verbosity(level)


# ---- the pair and the prompt, before any weight is read ----

# Where the draft cannot serve the target, the command line's ways on (only it gives the tokenizers)
OTHER_DRAFTS = (
    "pass a draft of the target's family, --draft int4 (the target's own 4-bit copy) or "
    "--draft none (prompt lookup alone)"
)


def preflight(target, draft, input_ids, eos_token_id=None, tokenizers=None):
    """Check a run's inputs; return (prompt as a list of ints, positions usable, EOS ids).
    input_ids None: the pair alone (a chat, before its first turn).

    target, draft: models or Opened folders (anything with `.config`); draft None: plain
    decoding. tokenizers: (target's, draft's), given by the CLI: ids must name the same strings
    in both and have a row in both embeddings. Checked: the draft proposes no token the target
    lacks; the prompt is token ids, not empty, shorter than both contexts, inside both
    vocabularies; the EOS ids are ids (default: those of the target's generation config and
    the target's tokenizer)."""
    models = dict(model=target) if draft is None else dict(target=target, draft=draft)
    for role, model in models.items():  # a folder's name, say, is not yet a model
        if not hasattr(getattr(model, "config", None), "vocab_size"):
            raise SpecExecError(
                f"the {role} must be a causal LM (transformers', offload's or models.load's), "
                f"got {type(model).__name__}"
            )
    if tokenizers is not None:  # ids must name the same strings in both, or drafting means nothing
        t_vocab = tokenizers[0].get_vocab()
        d_vocab = tokenizers[1].get_vocab()
        if t_vocab != d_vocab:
            differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])
            raise SpecExecError(
                f"target and draft tokenizers differ ({len(t_vocab)} vs {len(d_vocab)} tokens; "
                f"first difference: {differ[0][0]!r} id {differ[0][1]}); they must share one: "
                f"{OTHER_DRAFTS}"
            )
        for model in models.values():  # and each id a row in each model's embedding
            if len(tokenizers[0]) > model.config.vocab_size:
                raise SpecExecError(
                    f"{getattr(model, 'folder', 'a model')}: the tokenizer gives ids up to "
                    f"{len(tokenizers[0]) - 1}, but the model's vocabulary holds "
                    f"{model.config.vocab_size}"
                )
    # Every token the draft proposes must be one the target has: its vocabulary is no larger
    if draft is not None and draft.config.vocab_size > target.config.vocab_size:
        raise SpecExecError(
            f"the draft's vocabulary ({draft.config.vocab_size}) is larger than the target's "
            f"({target.config.vocab_size}); they must share a tokenizer"
            + (f": {OTHER_DRAFTS}" if tokenizers else "")  # the command line's
        )
    # the context: the positions every model here can use
    limit = min(model.config.max_position_embeddings for model in models.values())
    seq = None if input_ids is None else prompt_tokens(input_ids, limit, **models)
    return seq, limit, stop_tokens(eos_token_id, target, tokenizers[0] if tokenizers else None)


def prompt_tokens(input_ids, limit, **models):
    """The prompt as a list of ints, checked against the context and each model's vocabulary.

    input_ids: a list of ints or an integer tensor (n,) or (1, n). models: role=model.
    """
    try:
        ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError) as error:
        raise SpecExecError(f"input_ids must be a list of token ids ({error})") from None
    if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
        raise SpecExecError(f"input_ids must be (n,) or (1, n), got shape {tuple(ids.shape)}")
    if ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
        raise SpecExecError(f"input_ids must be integer token ids, got {ids.dtype}")
    try:  # a meta tensor (or another without data) has shape and dtype but no values
        seq = ids.reshape(-1).tolist()
    except (NotImplementedError, RuntimeError) as error:
        raise SpecExecError(f"input_ids holds no values to read ({one_line(error)})") from None
    if not seq:
        raise SpecExecError("the prompt is empty")
    if len(seq) >= limit:
        raise SpecExecError(f"the prompt has {len(seq)} tokens; the context holds {limit}")
    for role, model in models.items():
        vocab = model.config.vocab_size
        if outside := [token for token in seq if not 0 <= token < vocab]:
            raise SpecExecError(
                f"token id {outside[0]} is outside the {role}'s vocabulary ({vocab} tokens)"
            )
    return seq


def stop_tokens(eos_token_id, model, tokenizer=None):
    """Token ids to stop after: those given (an integer, numpy's and tensors' too, or a list of
    them), else every EOS the model's generation config names and, given a tokenizer (the CLI
    does), its own. `eos_token_id=[]` never stops early."""
    if eos_token_id is None:
        config = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos_token_id = token_ids(config) + token_ids(getattr(tokenizer, "eos_token_id", None))
    ids = token_ids(eos_token_id)
    for token in ids:  # a string is no list of ids, nor True the id 1
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise SpecExecError(f"eos_token_id must be token ids (integers), got {token!r}")
    return {int(token) for token in ids}


def token_ids(ids):
    """None, one id, or a list, tuple, set or tensor of them: a list."""
    ids = ids.tolist() if hasattr(ids, "tolist") else ids  # tensors and numpy's
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple, set, frozenset)) else [ids]


# ---- loading into memory ----


def load(opened, device, dtype=None) -> torch.nn.Module:
    """The model in memory, on `device`, in `dtype` (None: the checkpoint's own), from a folder
    `open_model` checked (or a folder or hub id, opened here); offload.from_pretrained streams
    the same Opened instead."""
    opened = open_model(opened)
    dtype = as_dtype(dtype) or opened.checkpoint.dtype
    model = skeleton(opened.config, opened.folder, dtype)
    load_weights(opened, model, device, dtype)
    return model


def load_weights(opened: Opened, model, device, dtype, layers=True) -> None:
    """Give `model` (a skeleton of `opened`) the checkpoint's tensors on `device` in `dtype`:
    all of them, or with layers=False all but the decoder layers' (offload.py streams those).
    The model keeps the folder's generation config."""
    tied = ties_head(model)
    # Buffers (rotary frequencies, Gemma's embedding scale) are computed, not stored: give them
    # memory on the device and let the model's own initializer compute them, while the
    # parameters are still meta (it would overwrite loaded ones).
    for name, buffer in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = torch.empty_like(buffer, device=device)
    for owner in {name.rpartition(".")[0] for name, _ in model.named_buffers()}:
        model._init_weights(model.get_submodule(owner))
    for name, buffer in model.named_buffers():  # before a weight is read, or an ssd copy made
        if buffer.is_floating_point() and not torch.isfinite(buffer).all():
            raise OffloadError(
                f"{opened.folder}: config.json is broken: the model computes its {name} from it "
                "as NaN or inf (rope_theta, say)"
            )
    tensors = {
        name: opened.checkpoint.tensor(name).to(device=device, dtype=dtype)
        for name, param in model.named_parameters()  # a tied head is listed once, as EMBEDDING
        if layers or not name.startswith("model.layers.")
    }
    model.load_state_dict(tensors, strict=False, assign=True)
    if tied:  # the head still holds the embedding's meta tensor: tie it to the new one
        model.lm_head.weight = model.model.embed_tokens.weight
    if opened.generation_config is not None:
        model.generation_config = opened.generation_config
    model.requires_grad_(False).eval()


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from itself or its name ("float16", "torch.bfloat16")."""
    if not isinstance(dtype, str):
        return dtype
    if not isinstance(found := getattr(torch, dtype.removeprefix("torch."), None), torch.dtype):
        raise OffloadError(f"dtype {dtype!r} is no torch dtype; try 'float16' or 'bfloat16'")
    return found


def as_device(device: torch.device | str | None) -> torch.device:
    """A torch device from itself or its name (None: cuda if available, else cpu), one that the
    project runs on, in memory or offloaded: the cpu or an available cuda device."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise OffloadError(f"device {device!r}: {one_line(err)}") from None
    if device.type != "cpu" and not (device.type == "cuda" and torch.cuda.is_available()):
        raise OffloadError(f"no {device} device here: the cpu or an available cuda device")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise OffloadError(f"{device}: only {torch.cuda.device_count()} cuda devices here")
    return device


def check_dtype_runs(device: torch.device, dtype: torch.dtype) -> None:
    """Fail now, not mid-generation, if the device cannot run a matmul and softmax in `dtype`."""
    old_gpu = device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False)
    if dtype == torch.bfloat16 and old_gpu:  # emulated bfloat16 runs, slowly
        raise OffloadError(f"{device} has no native bfloat16; pass dtype=torch.float16")
    try:
        x = torch.ones(2, 8, dtype=dtype, device=device)  # (2, 8)
        torch.softmax(x @ x.T, dim=-1)
    except (RuntimeError, NotImplementedError, TypeError) as err:
        reason = one_line(err)
        raise OffloadError(f"{device} cannot run {dtype} ({reason}); pass another dtype") from None
