"""Which decoder models a tree pass can run, and how far back each of their layers looks.

`specexec.tree_forward` builds one tree attention mask per kind of layer from what this file
hears; `offload_files.load_configs` asks it before a model's weights are read, so that an
unsupported model is refused in one line by the in-memory and the offloaded path alike.
"""

import copy
import weakref
from importlib.metadata import version

import torch

from checks import SpecExecError


class UnsupportedModel(SpecExecError):
    """A model whose layers a tree pass cannot run, reported to the user in one line."""


# How a model is handed its KV cache: transformers 5.24 renamed the forward's `past_key_values`
# to `cache` (the old name warns on stderr, and goes in 5.40). Every call passes `**{CACHE: c}`.
CACHE = (
    "cache" if [*map(int, version("transformers").split(".")[:2])] >= [5, 24] else "past_key_values"
)

_windows = weakref.WeakKeyDictionary()  # model -> attention_windows(model)


def attention_windows(model):
    """How far back each decoder layer looks: {None: window} when all layers share one, else
    {layer type: window} (the keys of `config.layer_types`); window None = the whole prefix.

    A tree needs the mask each layer would build for itself, and what a layer does is decided
    by its code, not by the config's fields: a Llama config may carry `sliding_window`, which
    Llama never applies. So we ask the layers. Each attention layer hands its window to the
    attention function (kernels such as flash-attention slide by it; sdpa and eager slide by
    the mask the model builds from the same setting). We build the model from its config on
    the meta device (no memory, no compute), run one token through it with an attention
    function that only listens, and read what every layer passed. The same run checks that
    every layer is attention that takes our 4D mask as given; one that is not (a recurrent
    state, which cannot be rolled back to the accepted path) is refused in one line.
    """
    if model not in _windows:
        _windows[model] = listen_to_layers(model.config)
    return _windows[model]


def listen_to_layers(config):
    """`attention_windows`, heard from a model built from `config` on the meta device."""
    from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache

    family, n_layers = config.model_type, config.num_hidden_layers
    given = torch.zeros(1, 1, 1, 1, device="meta")  # (1, 1, 1, 1): the 4D mask we pass
    heard = {}  # layer index -> (the window it passes, whether it got our mask)

    def listen(module, query, key, value, attention_mask, sliding_window=None, **kwargs):
        heard[module.layer_idx] = (sliding_window, attention_mask is given)
        batch, heads, n, _ = query.shape  # what attention returns: (batch, n, heads, v_dim)
        return query.new_zeros(batch, n, heads, value.shape[-1]), None

    AttentionInterface.register("specexec_listen", listen)
    config = copy.deepcopy(config)  # from_config keeps the config it is given, and edits it
    try:
        # The cache transformers builds for it says what each layer keeps: a step keeps the
        # accepted path by gathering its keys and values, which a recurrent state (Mamba,
        # linear attention) or a compressed one does not hold.
        for layer, kept in enumerate(DynamicCache(config=config).layers):
            if type(kept).__name__ not in ("DynamicLayer", "DynamicSlidingWindowLayer"):
                raise UnsupportedModel(
                    f"{family} is not supported: layer {layer} keeps a {type(kept).__name__}, "
                    "not only keys and values: a tree's accepted path cannot be kept"
                )
        with torch.device("meta"):  # batched_mm: a mixture's experts as they run on meta
            model = AutoModelForCausalLM.from_config(config, experts_implementation="batched_mm")
            model.config._attn_implementation = "specexec_listen"
            one = torch.zeros(1, 1, dtype=torch.long)  # (1, 1)
            model(one, attention_mask=given, position_ids=one, **{CACHE: DynamicCache()})
    except UnsupportedModel:
        raise
    except Exception as error:  # what a family raises on meta tensors or a plain cache varies
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
