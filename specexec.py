"""SpecExec: massively parallel speculative decoding, in one readable file.

Svirschevski et al., "SpecExec: Massively Parallel Speculative Decoding for Interactive LLM
Inference on Consumer Devices", arXiv 2406.02532.

The idea. When a big *target* model's weights stream from RAM or SSD for every forward pass,
a pass over a thousand tokens costs about as much as a pass over one. So a small *draft*
model grows a large tree of likely continuations, best-first by cumulative draft
probability, and keeps the `budget` most probable nodes. The target then scores the whole
tree in ONE pass, with an attention mask that lets each node see only its ancestors. We walk
the tree from the root, following the target's own choice at each node while that choice is
a child in the tree, and finish with the target's choice at the last node reached (the
bonus token). Every token is the target's own choice, so the output is exactly what the
target alone would produce: its greedy decoding at temperature 0, an exact sample otherwise.

Words of the paper -> names in the code:

    target model (large, slow)            target
    draft model (small, fast)             draft
    token budget / tree size              budget        (draft nodes verified per step)
    max tree depth / draft iterations     max_depth     (draft passes per step)
    beam width (nodes expanded per pass)  width
    children kept per expanded node       branch
    cumulative (path) probability         cum_logprob   (log of the draft's path probability,
                                                         at `Options.tree_temperature()`)
    last accepted, not yet seen token     root          (the "pending" token; the tree's root)
    bonus token                           bonus
    one target forward pass               a step        (Stats.steps)

The sequence `seq` is the prompt plus every accepted token. The invariant that makes the
caches simple: after each step, each model's KV cache holds a prefix of `seq` that does not
include its last token (the root of the next tree); a model is always fed the part of `seq`
its cache lacks (the "trunk") before anything else. The first step's trunk is the prompt.
`speculative_step` checks the invariant at the end of every step.
"""

if __name__ == "__main__":  # `python specexec.py`: the command line, before the slow imports below
    import cli  # (it imports this file as `specexec`, and exits quietly on Ctrl-C meanwhile)

    cli.main()
    raise SystemExit

import heapq
import math
import numbers
import time
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch


class SpecExecError(ValueError):
    """Bad input, reported to the user in one line."""


# ---- config ----


def option(default, help):
    """A config field and its help text (the CLI's `--help` shows it)."""
    return field(default=default, metadata={"help": help})


@dataclass
class Options:
    """Generation options: one source of defaults for `generate`, `autoregressive` and the CLI."""

    max_new_tokens: int = option(128, "stop after this many new tokens")
    budget: int | str = option(
        256, 'draft tree size: nodes verified per step; "auto": chosen as it runs (CostModel)'
    )
    max_depth: int = option(16, "max tree depth = draft passes per step")
    width: int = option(32, "beam width: nodes expanded per draft pass")
    branch: int = option(8, "children kept per expanded node")
    temperature: float = option(0.0, "0 = greedy (exact argmax)")
    top_p: float = option(1.0, "nucleus sampling mass (1 = off)")
    top_k: int = option(0, "sample from the k most likely (0 = off)")
    seed: int | None = option(None, "random seed for sampling (default: a fresh one)")
    draft_threads: int | None = option(
        1, "CPU threads for the draft's passes (None: torch's setting); output is unchanged"
    )
    draft_temperature: float | None = option(
        None,
        "the draft's temperature when it ranks the tree (default: 0.3 when greedy, "
        "else the sampling temperature); output is unchanged",
    )

    def __post_init__(self):
        for f in fields(self):
            value, integer = getattr(self, f.name), f.type in (int, int | str, int | None)
            if f.name == "budget" and value == "auto":
                continue
            kind = numbers.Integral if integer else numbers.Real  # a bool is no count
            if (value is not None or f.default is not None) and (
                isinstance(value, bool) or not isinstance(value, kind)
            ):
                kind = "an integer" if integer else "a number"
                kind += ' or "auto"' if f.name == "budget" else ""
                raise SpecExecError(f"{f.name} must be {kind}, got {value!r}")
        for name in ("budget", "max_depth", "width", "branch", "draft_threads"):
            if getattr(self, name) not in ("auto", None) and getattr(self, name) < 1:
                raise SpecExecError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_new_tokens < 0 or self.top_k < 0:
            raise SpecExecError("max_new_tokens and top_k cannot be negative")
        # A floor: logits / temperature stays finite for any float32 logit (3.4e38 / 1e-4 fits
        # a float64), and below 1e-4 sampling is greedy decoding in all but exact ties anyway.
        if not (self.temperature == 0 or 1e-4 <= self.temperature < math.inf):
            raise SpecExecError(f"temperature must be 0 or in [1e-4, inf), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecExecError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise SpecExecError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.draft_temperature is not None and not 1e-2 <= self.draft_temperature < math.inf:
            raise SpecExecError(
                f"draft_temperature must be in [0.01, inf), got {self.draft_temperature}"
            )

    def tree_temperature(self):
        """The draft's temperature when it ranks tree nodes. The tree should hold the paths the
        target is most likely to follow. Sampling at temperature t, that is the draft's path
        probability at t. Greedy, the target follows the draft's top choice far more often than
        a flat draft's probability says (on the default pair: 65% of held-out positions, at a
        draft probability of 42%), so a sharpened draft (0.3) ranks paths better: deeper trees,
        1.1x the tokens per step at budget 256 (README). Neither changes what is emitted."""
        if self.draft_temperature is not None:
            return self.draft_temperature
        return self.temperature if self.temperature > 0 else 0.3


@dataclass
class Stats:
    """What a run did. `steps` counts target forward passes."""

    steps: int = 0
    new_tokens: int = 0
    draft_passes: int = 0
    accepted: list = field(default_factory=list)  # tokens emitted per step (path + bonus)
    tree_sizes: list = field(default_factory=list)  # nodes verified per step
    choices: list = field(default_factory=list)  # (budget, depth) per step; budget 0: no tree
    cost_model: "CostModel | None" = None  # budget "auto": what it measured and predicted
    time_draft: float = 0.0
    time_target: float = 0.0
    time_total: float = 0.0

    @property
    def tokens_per_step(self):
        return self.new_tokens / max(1, self.steps)

    @property
    def tokens_per_second(self):
        return self.new_tokens / max(1e-9, self.time_total)

    @property
    def time_other(self):
        return self.time_total - self.time_draft - self.time_target

    @property
    def histogram(self):
        """How many steps gained k tokens, for each k."""
        return dict(sorted(Counter(self.accepted).items()))

    def summary(self):
        """One line: what was made, per target pass and per second, and where the time went."""
        passes = f"{self.steps} target pass{'es' * (self.steps != 1)}"
        line = (
            f"{self.new_tokens} tokens in {passes} ({self.tokens_per_step:.2f} per pass), "
            f"{self.tokens_per_second:.3g} tokens/s; draft {self.time_draft:.2f}s, target "
            f"{self.time_target:.2f}s, other {self.time_other:.2f}s"
        )
        trees = [choice for choice in self.choices if choice[0]]
        if trees:  # SpecExec, not the baseline
            (budget, depth), n = Counter(trees).most_common(1)[0]
            line += f"; budget {budget}, depth {depth}"
            if len(set(trees)) > 1:
                line += f" in {n} of {len(self.choices)} steps"
        if len(trees) < len(self.choices):
            line += f"; plain decoding (no tree) in {len(self.choices) - len(trees)} steps"
        return line


@contextmanager
def timer(stats, name, device):
    """Add the wall time of a block to `stats.<name>`; wait for the GPU so the split is true."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    yield
    sync()
    setattr(stats, name, getattr(stats, name) + time.perf_counter() - start)


@contextmanager
def cpu_threads(n, device):
    """Run a block on `n` CPU threads (n None, or a GPU: as it is). A draft pass is a few small
    matmuls: more threads do not make it faster, and on a busy CPU they wait for each other
    (README, "Where the time goes")."""
    if n is None or torch.device(device).type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- input checks ----


def context_length(config):
    """Positions the model can use."""
    return config.max_position_embeddings


def check_same_vocab_size(target_config, draft_config):
    """Token ids must mean the same in both models (the CLI also compares token strings)."""
    if draft_config.vocab_size > target_config.vocab_size:
        raise SpecExecError(
            f"the draft's vocabulary ({draft_config.vocab_size}) is larger than the target's "
            f"({target_config.vocab_size}); they must share a tokenizer"
        )


def check_prompt(seq, limit):
    if not seq:
        raise SpecExecError("the prompt is empty")
    if len(seq) >= limit:
        raise SpecExecError(f"the prompt has {len(seq)} tokens; the context holds {limit}")


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
    seq = ids.reshape(-1).tolist()
    check_prompt(seq, limit)
    for role, model in models.items():
        vocab = model.config.vocab_size
        outside = [token for token in seq if not 0 <= token < vocab]
        if outside:
            raise SpecExecError(
                f"token id {outside[0]} is outside the {role}'s vocabulary ({vocab} tokens)"
            )
    return seq


def stop_tokens(eos_token_id, model):
    """Token ids to stop after: those given (an integer, numpy's and tensors' too, or a list of
    them), else the model's generation config's. `eos_token_id=[]` never stops early."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = eos_token_id.tolist() if hasattr(eos_token_id, "tolist") else eos_token_id  # tensors
    ids = ids if isinstance(ids, (list, tuple, set, frozenset)) else [] if ids is None else [ids]
    for token in ids:  # a string is no list of ids, nor True the id 1
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise SpecExecError(f"eos_token_id must be token ids (integers), got {token!r}")
    return {int(token) for token in ids}


def check_finite(logits, role):
    """NaN or inf logits (broken weights, a negative rms_norm_eps) would pick token 0 or garbage
    and run on; checked once per pass, on the rows the pass's choices are made from. A NaN or
    inf anywhere makes the sum NaN or inf: one reduction, 20x cheaper than isfinite().all(),
    summed in float32 so that half-precision logits cannot overflow it."""
    if not math.isfinite(logits.sum(dtype=torch.float32)):
        raise SpecExecError(
            f"the {role} model computes logits that are not finite (NaN or inf): "
            "its weights or its config.json (e.g. rms_norm_eps) are broken"
        )


# ---- sampling helpers ----


def sampling_probs(logits, temperature, top_k, top_p):
    """The target's next-token distribution after temperature, top-k and top-p (nucleus)."""
    logits = logits.double() / temperature  # (vocab,)
    if top_k > 0:
        kth_best = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    probs = torch.softmax(logits, -1)  # (vocab,)
    if top_p < 1.0:
        # Nucleus: the smallest set of most likely tokens whose mass reaches top_p. A token is
        # dropped when the tokens ranked above it already reach top_p on their own.
        sorted_probs, order = probs.sort(descending=True)  # (vocab,) each
        mass_above = sorted_probs.cumsum(0) - sorted_probs  # (vocab,)
        dropped = order[mass_above >= top_p]
        probs = probs.index_fill(0, dropped, 0.0)
    return probs / probs.sum()


def choose(logits, opts, rng):
    """The target's pick: argmax at temperature 0, else one sample (one uniform draw)."""
    if opts.temperature == 0:
        return int(logits.argmax())
    probs = sampling_probs(logits, opts.temperature, opts.top_k, opts.top_p).cpu()  # (vocab,)
    cdf = probs.cumsum(0)  # (vocab,)
    u = torch.rand((), generator=rng, dtype=torch.float64) * cdf[-1]
    # The first token whose cdf exceeds u; zero-probability tokens can never be chosen.
    return int(torch.searchsorted(cdf, u, right=True))


# ---- tree attention mask ----


def tree_mask(parents, n_cached, dtype, device, window=None, n_new=None):
    """Additive attention mask and position ids for `len(parents)` tree tokens after `n_cached`.

    parents[i] < i is the index of token i's parent among the tree tokens, or -1 when its
    parent is the last of the n_cached tokens. Token i may look at those n_cached tokens, its
    ancestors and itself. A causal mask is the tree mask of a chain: parents = [-1, 0, 1, ...].
    With a sliding `window`, it may also look no further back than `window - 1` positions.
    Only the rows of the last `n_new` tree tokens are made (default: all of them); a draft
    pass feeds a few nodes below those of earlier passes, which are in its cache already.
    Returns mask (1, 1, n_new, n_cached + n): 0 = may look, finfo.min = may not; and position
    ids (1, n_new) = n_cached + depth (the number of ancestors among the tree tokens). The
    mask must be an additive float: Hugging Face passes a 4D mask through untouched, and a
    boolean one would be misread by eager attention.
    """
    n = len(parents)
    new = slice(n - (n if n_new is None else n_new), n)  # the rows asked for
    parent = torch.tensor(parents, dtype=torch.long)  # (n,)
    sees = torch.eye(n, dtype=torch.bool)  # (n, n): sees[i, j] = j is i or an ancestor of i
    depth = torch.zeros(n, dtype=torch.long)  # (n,): how many of the n tokens are ancestors
    # Walk every token up its chain of ancestors at once; the walk ends at the tree's depth.
    node = parent.clone()  # (n,): the ancestor each token reached so far
    while (climbing := (node >= 0).nonzero()[:, 0]).numel():  # (n_climbing,)
        sees[climbing, node[climbing]] = True
        depth[climbing] += 1
        node[climbing] = parent[node[climbing]]
    sees, positions = sees[new], n_cached + depth  # (n_new, n), (n,)
    # Only the new rows become floats: a draft pass adds a few rows below a large tree.
    blocked = torch.full(sees.shape, torch.finfo(dtype).min, dtype=dtype)  # (n_new, n)
    cached = torch.zeros(len(sees), n_cached, dtype=dtype)  # (n_new, n_cached): all visible
    mask = torch.cat([cached, blocked.masked_fill_(sees, 0.0)], -1)  # (n_new, n_cached + n)
    if window is not None:
        key_positions = torch.cat([torch.arange(n_cached), positions])  # (n_cached + n,)
        too_far = positions[new, None] - key_positions[None, :] >= window  # (n_new, n_cached + n)
        mask.masked_fill_(too_far, torch.finfo(dtype).min)
    return mask[None, None].to(device), positions[None, new].to(device)


def chain(n):
    """Parents of n tokens in a row (a causal mask)."""
    return list(range(-1, n - 1))


def tree_forward(model, cache, tokens, parents):
    """Run new `tokens` after the cache, as the last nodes of the tree `parents`; their logits.

    One call serves the prompt (a chain), each draft pass and the target's verification.
    `parents` may start with tree nodes fed earlier, which are then the last entries of the
    cache (the draft's earlier passes); -1 marks a child of the last token before the tree.
    A sliding-window layer gets the same mask with its window applied, as `attention_windows`
    finds them; the cache keeps every entry, so generation runs past the window exactly.
    """
    n_old = len(parents) - len(tokens)  # tree nodes already in the cache
    n_prefix = cache.get_seq_length() - n_old
    rows = dict(dtype=model.dtype, device=model.device, n_new=len(tokens))
    masks = {}  # layer type -> (1, 1, n, n_prefix + n_old + n) mask; None: every layer
    for kind, window in attention_windows(model).items():
        masks[kind], positions = tree_mask(parents, n_prefix, window=window, **rows)
    input_ids = torch.tensor([tokens], dtype=torch.long, device=model.device)  # (1, n)
    out = model(
        input_ids=input_ids,
        attention_mask=masks.get(None, masks),  # one for all layers, or a dict by layer type
        position_ids=positions,  # (1, n)
        past_key_values=cache,
        use_cache=True,
    )
    return out.logits[0]  # (n, vocab)


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
    import copy

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
                raise SpecExecError(
                    f"{family} is not supported: layer {layer} keeps a {type(kept).__name__}, "
                    "not only keys and values: a tree's accepted path cannot be kept"
                )
        with torch.device("meta"):  # batched_mm: a mixture's experts as they run on meta
            model = AutoModelForCausalLM.from_config(config, experts_implementation="batched_mm")
            model.config._attn_implementation = "specexec_listen"
            one = torch.zeros(1, 1, dtype=torch.long)  # (1, 1)
            model(one, attention_mask=given, position_ids=one, past_key_values=DynamicCache())
    except SpecExecError:
        raise
    except Exception as error:  # what a family raises on meta tensors or a plain cache varies
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise SpecExecError(f"{family} is not supported: a tree pass fails ({reason})") from None
    for layer in range(n_layers):
        window, takes_mask = heard.get(layer, (None, None))
        if takes_mask is None:
            raise SpecExecError(
                f"{family} is not supported: layer {layer} does not attend through "
                "transformers' attention functions, so its tree mask cannot be checked"
            )
        if not takes_mask:
            raise SpecExecError(f"{family} is not supported: its attention ignores a 4D mask")
        if window is not None and window < 1:
            raise SpecExecError(f"{family}: a sliding window of {window} lets a token see nothing")
    windows = [heard[layer][0] for layer in range(n_layers)]  # None: no window
    if len(set(windows)) < 2:
        return {None: next(iter(windows), None)}
    # Layers that differ pick their mask from a dict by layer type (Gemma 2, Qwen2, SmolLM3)
    kinds = getattr(config, "layer_types", None) or []
    by_kind = dict(zip(kinds, windows))
    if [by_kind.get(kind) for kind in kinds] != windows or len(kinds) != n_layers:
        raise SpecExecError(f"{family} is not supported: its layers' windows differ by no type")
    return by_kind


# ---- draft tree (priority queue) ----


@dataclass
class DraftTree:
    """Every node the draft discovered. Node 0 is the root: the last token of `seq`."""

    tokens: list  # token of each node
    parents: list  # parent node of each node; -1 for the root
    cum_logprob: list  # draft log-probability of the path from the root (root: 0)
    depth: list  # edges from the root (root: 0)
    budget: int  # how many nodes (besides the root) the target will verify
    candidates: list = field(default_factory=list)  # heap of keys: found, not yet fed, best first
    best_so_far: list = field(default_factory=list)  # heap: the `budget` best nodes, worst first
    fed: list = field(default_factory=list)  # nodes (not the root) in the draft's cache, in order

    def key(self, node):
        """Best first: higher cum_logprob; on a tie the earlier node, so parents come first."""
        return (-self.cum_logprob[node], node)

    def add_children(self, nodes, logprobs, branch):
        """Add each node's `branch` most probable children, as candidates and to `best_so_far`.

        logprobs: (len(nodes), vocab), the draft's next-token log-probabilities at each node.
        """
        check_finite(logprobs, "draft")
        top = torch.topk(logprobs, min(branch, logprobs.shape[-1]))  # (len(nodes), branch) each
        for node, values, tokens in zip(nodes, top.values.tolist(), top.indices.tolist()):
            for logprob, token in zip(values, tokens):
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.cum_logprob.append(self.cum_logprob[node] + logprob)
                self.depth.append(self.depth[node] + 1)
                # `best_so_far` is ordered by the negated key, so its top is the worst of them;
                # once full, a newcomer pushes out the worst, or itself if it is worse. Then
                # neither it nor its children can ever enter: it is no candidate either.
                negated = (self.cum_logprob[child], -child)
                if len(self.best_so_far) < self.budget:
                    heapq.heappush(self.best_so_far, negated)
                elif heapq.heappushpop(self.best_so_far, negated) == negated:
                    continue
                heapq.heappush(self.candidates, self.key(child))

    def worst_kept(self):
        """The key of the worst of the `budget` best nodes, and whether there are `budget`."""
        logprob, negated_node = self.best_so_far[0]
        return (-logprob, -negated_node), len(self.best_so_far) == self.budget

    def best(self):
        """The `budget` most probable nodes except the root, parents before children.

        This set is always a tree (closed under ancestors): a child's path is its parent's
        path times one more probability <= 1, so the child never ranks above its parent,
        and ties go to the earlier node, which the parent is.
        """
        return sorted(-negated_node for _, negated_node in self.best_so_far)

    def local_parents(self, nodes):
        """Each node's parent as an index into `nodes` (-1: the root), as `tree_mask` takes them.

        `nodes` lists parents before children and is closed under ancestors, but for the root.
        """
        index = {0: -1} | {node: i for i, node in enumerate(nodes)}
        return [index[self.parents[node]] for node in nodes]


def grow_tree(draft, cache, seq, opts, stats, limit, budget=None, max_depth=None):
    """Best-first search for the `budget` most probable continuations of `seq`.

    A heap holds the candidates: nodes discovered but not yet fed to the draft. Each draft
    pass takes the `width` best of them, runs them in one tree-masked batch (reusing the
    cache of the prefix and of all nodes fed before), and pushes each one's `branch` best
    children. Passes per tree are bounded by the depth, whatever the budget: `max_depth`, less
    near the end of the context (`limit` positions). Both default to `opts`'.
    """
    budget = opts.budget if budget is None else budget
    max_depth = opts.max_depth if max_depth is None else max_depth
    # Pass 1: feed the trunk (what the draft's cache lacks, ending with the root).
    trunk = seq[cache.get_seq_length() :]
    if max(trunk) >= draft.config.vocab_size:  # the prompt was checked, the target's picks not
        raise SpecExecError(f"the target chose token id {max(trunk)}, which the draft lacks")
    logits = tree_forward(draft, cache, trunk, chain(len(trunk)))  # (len(trunk), vocab)
    stats.draft_passes += 1
    tree = DraftTree(tokens=[seq[-1]], parents=[-1], cum_logprob=[0.0], depth=[0], budget=budget)
    sharpness = opts.tree_temperature()
    logprobs = torch.log_softmax(logits[-1:].float() / sharpness, -1)  # (1, vocab)
    tree.add_children([0], logprobs, opts.branch)

    # Tree nodes at depth d sit at position len(seq) - 1 + d, which must fit the context.
    for _ in range(min(max_depth, limit - len(seq)) - 1):
        # A candidate outside today's best `budget` nodes can never enter it (the set only
        # gets better), nor can its descendants, so expanding it is wasted work. Once the set
        # is full, neither is expanding its worst node: its children would rank below it.
        worst_kept, full = tree.worst_kept()
        batch = []
        while tree.candidates and len(batch) < opts.width:
            if full and tree.candidates[0] >= worst_kept:
                break
            batch.append(heapq.heappop(tree.candidates)[1])
        if not batch:
            break
        parents = tree.local_parents(tree.fed + batch)  # the fed nodes are in the cache
        logits = tree_forward(draft, cache, [tree.tokens[node] for node in batch], parents)
        stats.draft_passes += 1
        tree.fed += batch
        logprobs = torch.log_softmax(logits.float() / sharpness, -1)  # (len(batch), vocab)
        tree.add_children(batch, logprobs, opts.branch)
    return tree


# ---- verification and acceptance ----


def verify(target, cache, seq, tree, kept):
    """ONE target pass over the trunk and the kept tree nodes; logits at the root and each node."""
    trunk = seq[cache.get_seq_length() :]  # usually just the root; the whole prompt at first
    # After the trunk, local parent -1 (the root) lands on the trunk's last token.
    parents = chain(len(trunk)) + [len(trunk) + i for i in tree.local_parents(kept)]
    tokens = trunk + [tree.tokens[node] for node in kept]
    logits = tree_forward(target, cache, tokens, parents)  # (len(trunk) + len(kept), vocab)
    return logits[len(trunk) - 1 :]  # (1 + len(kept), vocab): root first, then kept


def accept(tree, kept, logits, opts, rng):
    """Follow the target's own picks down the tree; return the accepted nodes and the bonus.

    At each node the target chooses the next token from its own distribution. If that token
    is a child in the tree we move there for free; if not, the choice itself is the bonus
    token. Every emitted token is thus the target's choice given everything before it, so
    the output is the target's greedy decoding (temperature 0) or an exact sample from it.
    """
    row = {node: i for i, node in enumerate([0] + kept)}  # each node's row of `logits`
    child = {(tree.parents[node], tree.tokens[node]): node for node in kept}
    path, node = [], 0
    while True:
        token = choose(logits[row[node]], opts, rng)  # one uniform draw per visited node
        if (node, token) not in child:
            check_finite(logits[[row[visited] for visited in [0, *path]]], "target")
            return path, token
        node = child[(node, token)]
        path.append(node)


def keep_path(cache, nodes, path):
    """Drop the tree from the cache but for `path`.

    The cache ends with one entry per node of `nodes`, in order; what precedes them stays,
    as do the entries of `path`'s nodes (those the cache holds). `DynamicCache.crop` can only
    drop a suffix, and the path is scattered among the tree's entries, so we gather.
    """
    n_prefix = cache.get_seq_length() - len(nodes)
    position = {node: n_prefix + i for i, node in enumerate(nodes)}
    keep = list(range(n_prefix)) + [position[node] for node in path if node in position]
    for layer in cache.layers:
        index = torch.tensor(keep, dtype=torch.long, device=layer.keys.device)  # (n_keep,)
        layer.keys = layer.keys.index_select(-2, index)  # (1, heads, n_keep, head_dim)
        layer.values = layer.values.index_select(-2, index)


def speculative_step(
    target, draft, target_cache, draft_cache, seq, opts, rng, stats, limit, cost=None
):
    """One SpecExec step: draft tree, one target pass, acceptance, cache update; new tokens.

    With `cost` (budget "auto"), the step's budget and depth are the cost model's choice, and
    budget 0 is plain decoding: no tree, no draft pass (the draft's cache then lags behind
    `seq`, and its next tree's trunk catches it up).
    """
    started, draft_s, target_s = time.perf_counter(), stats.time_draft, stats.time_target
    budget, depth = cost.choose() if cost else (opts.budget, opts.max_depth)
    draft_passes = stats.draft_passes
    with timer(stats, "time_draft", draft.device), cpu_threads(opts.draft_threads, draft.device):
        if budget:
            tree = grow_tree(draft, draft_cache, seq, opts, stats, limit, budget, depth)
        else:
            tree = DraftTree(tokens=[seq[-1]], parents=[-1], cum_logprob=[0.0], depth=[0], budget=0)
        kept = tree.best()
    n_fed = len(seq) - target_cache.get_seq_length() + len(kept)  # trunk and tree
    with timer(stats, "time_target", target.device):
        logits = verify(target, target_cache, seq, tree, kept)  # (1 + len(kept), vocab)
        path, bonus = accept(tree, kept, logits, opts, rng)

    # Both caches now hold all of `seq`, then tree nodes: the target's the kept ones, the
    # draft's the fed ones. Keep `seq` plus the accepted path; the bonus is the next root,
    # seen by neither. The path's last node may be a leaf the draft never fed: it is then
    # part of the draft's trunk at the next step.
    keep_path(target_cache, kept, path)
    keep_path(draft_cache, tree.fed, path)
    # The invariant: the target's cache holds the new `seq` but its last token (the bonus),
    # the draft's that too, or all but the path's last node if it never fed it (or less,
    # after a step without a tree).
    n_seen = len(seq) + len(path)
    lengths = draft_cache.get_seq_length(), target_cache.get_seq_length()
    assert n_seen - 1 <= lengths[0] or not budget, f"draft cache {lengths[0]}, {n_seen}"
    assert lengths[0] <= lengths[1] == n_seen, f"cache lengths {lengths}, {n_seen}"

    stats.tree_sizes.append(len(kept))
    stats.choices.append((budget, depth))
    if cost:
        draft_s, target_s = stats.time_draft - draft_s, stats.time_target - target_s
        other_s = time.perf_counter() - started - draft_s - target_s
        passes = stats.draft_passes - draft_passes
        cost.observe(n_fed, target_s, draft_s / max(1, passes), other_s, tree, kept, path, depth)
    return [tree.tokens[node] for node in path] + [bonus]


# ---- choosing the budget: the cost model ----


def running_mean(old, new, weight=0.3):
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class CostModel:
    """`budget="auto"`: before each step, the (budget, depth) with the most tokens per second.

    In the paper's terms a step yields E[tokens](b, d) and costs d draft passes, one target
    pass over the tree and some bookkeeping, so auto takes the (b, d) that maximises

        tokens/s = E[tokens](b, d) / (d * t_draft + t_target(b + 1) + t_other).

    The cost is measured as the run goes: t_target(n), the seconds of a target pass over n
    tokens, at each size run so far, and on straight lines between and beyond them; t_draft,
    one draft pass; t_other, the rest of a step (this choice included). The first pass, which
    also reads the prompt, is not a tree's cost. A tree up to `GROWTH` times the largest run so
    far is a candidate, so auto learns the cost of bigger trees a few sizes at a time.

    The gain is predicted from the trees the draft built: for the tree of the b best nodes no
    deeper than d, 1 (the bonus token) plus, for each node, the chance that the target follows
    the path to it, read off how often nodes of about that draft path probability were followed
    so far; averaged over recent steps. Budget 0 is plain decoding (E = 1, no draft pass);
    after `PLAIN_STEPS` of those in a row, one tree step looks at the draft's predictions
    again. Every `DEEPEN_EVERY` tree steps whose tree reaches its depth limit, the search goes
    one level deeper, so that auto can see whether a deeper tree pays.
    """

    max_depth: int
    budget: int = 8  # the first steps' (and depth: max_depth), before anything is measured
    depth: int | None = None
    target_s: dict = field(default_factory=dict)  # tokens fed -> seconds of the pass
    draft_s: float = 0.0  # seconds per draft pass
    other_s: float = 0.0
    followed: list = field(default_factory=lambda: [0] * 40)  # per bin of cum_logprob
    seen: list = field(default_factory=lambda: [0] * 40)
    gains: dict = field(default_factory=dict)  # (budget, depth) -> (E[tokens], passes)
    steps: int = 0
    tree_steps: int = 0
    plain_steps: int = 0  # in a row

    BUDGETS = tuple(2**k for k in range(11))  # 1 .. 1024: the tree sizes auto considers
    DEPTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    GROWTH, PLAIN_STEPS, DEEPEN_EVERY = 4, 8, 4

    def observe(self, n_fed, target_s, draft_pass_s, other_s, tree, kept, path, depth):
        """What a step cost, and which nodes of its tree (searched to `depth`) were followed."""
        if self.steps:  # the first pass reads the prompt too
            self.target_s[n_fed] = running_mean(self.target_s.get(n_fed), target_s)
        self.other_s = running_mean(self.other_s if self.steps else None, other_s)
        self.steps += 1
        self.plain_steps = 0 if kept else self.plain_steps + 1
        if not kept:
            return
        self.tree_steps += 1
        self.draft_s = running_mean(self.draft_s if self.tree_steps > 1 else None, draft_pass_s)
        for node in kept:
            self.seen[self.bin(tree.cum_logprob[node])] += 1
            self.followed[self.bin(tree.cum_logprob[node])] += node in path
        for choice, (gain, passes) in self.tree_gains(tree, depth).items():
            old_gain, old_passes = self.gains.get(choice, (None, None))
            self.gains[choice] = running_mean(old_gain, gain), running_mean(old_passes, passes)

    def bin(self, cum_logprob):
        """Half-nat bins of the draft's path log-probability (at the tree's temperature)."""
        return min(len(self.seen) - 1, int(-2 * cum_logprob))

    def follow_rate(self, cum_logprob):
        """How often the target followed nodes of this bin, with one prior node followed at the
        draft's own probability."""
        b = self.bin(cum_logprob)
        return (self.followed[b] + math.exp(cum_logprob)) / (self.seen[b] + 1)

    def tree_gains(self, tree, max_depth):
        """E[tokens] and draft passes of each (budget, depth) that a tree searched to max_depth
        can show. The tree of the b best nodes no deeper than d is the first b of them, best
        first; a search for it needs as many draft passes as it is deep."""
        ranked = sorted(range(1, len(tree.tokens)), key=tree.key)  # best first
        gains = {}
        for depth in (d for d in self.DEPTHS if d <= max_depth):
            gain, deepest, b = 1.0, 0, 0
            for node in (node for node in ranked if tree.depth[node] <= depth):
                b, gain = b + 1, gain + self.follow_rate(tree.cum_logprob[node])
                deepest = max(deepest, tree.depth[node])
                if b in self.BUDGETS:
                    gains[(b, depth)] = gain, deepest
                if b == self.BUDGETS[-1]:
                    break
        return gains

    def t_target(self, n):
        """Seconds of a target pass over n tokens: between two sizes run, on the line between
        them; outside, on the line through the nearest two (never below the nearest)."""
        sizes = sorted(self.target_s)
        if len(sizes) == 1:
            return self.target_s[sizes[0]]
        i = min(max(1, sum(size < n for size in sizes)), len(sizes) - 1)  # the segment
        (n0, t0), (n1, t1) = [(size, self.target_s[size]) for size in sizes[i - 1 : i + 1]]
        seconds = t0 + (t1 - t0) / (n1 - n0) * (n - n0)
        return max(seconds, t1) if n > n1 else max(seconds, 0.0)

    def rates(self):
        """Predicted tokens per second of each (budget, depth); budget 0 is no tree."""
        rates = {(0, 0): 1 / (self.t_target(1) + self.other_s)}
        largest = max(self.target_s)
        for (b, depth), (gain, passes) in self.gains.items():
            if b < self.GROWTH * largest:
                seconds = passes * self.draft_s + self.t_target(b + 1) + self.other_s
                rates[(b, depth)] = gain / seconds
        return rates

    def choose(self):
        """This step's (budget, depth)."""
        if not (self.gains and self.target_s):  # nothing measured yet
            return self.budget, self.max_depth
        rates = self.rates()
        if self.plain_steps >= self.PLAIN_STEPS:  # look at the draft again
            rates.pop((0, 0))
        self.budget, self.depth = max(rates, key=rates.get)
        reaches_limit = self.budget and self.gains[(self.budget, self.depth)][1] >= self.depth
        deeper = reaches_limit and self.tree_steps % self.DEEPEN_EVERY == 0
        return self.budget, min(self.depth + deeper, self.max_depth)


# ---- generation loop ----


def decode_loop(step, seq, opts, limit, eos, on_tokens):
    """The loop shared by SpecExec and the baseline: step until a stop condition holds."""
    rng = torch.Generator().manual_seed(opts.seed if opts.seed is not None else torch.seed())
    stats = Stats()
    new_tokens = []
    start = time.perf_counter()
    while len(new_tokens) < opts.max_new_tokens and len(seq) < limit:
        tokens = step(seq, rng, stats)
        # Cut at the token limit, the context, and just after the first EOS.
        tokens = tokens[: min(opts.max_new_tokens - len(new_tokens), limit - len(seq))]
        ends = [i for i, t in enumerate(tokens) if t in eos]
        tokens = tokens[: ends[0] + 1] if ends else tokens
        stats.steps += 1
        stats.accepted.append(len(tokens))
        seq += tokens
        new_tokens += tokens
        if on_tokens is not None:
            on_tokens(tokens)
        if ends:
            break
    stats.new_tokens = len(new_tokens)
    stats.time_total = time.perf_counter() - start
    return new_tokens, stats


@torch.no_grad()
def generate(target, draft, input_ids, *, eos_token_id=None, on_tokens=None, **options):
    """SpecExec decoding. Returns (new_tokens, Stats); the target alone would emit the same.

    input_ids: list of ints or a LongTensor (1, n). options: see `Options`.
    eos_token_id: an int or a list; by default the target's generation config's; [] = none.
    on_tokens(list[int]) is called with each step's accepted tokens (for streaming).
    """
    from transformers import DynamicCache

    opts = Options(**options)
    check_same_vocab_size(target.config, draft.config)
    limit = min(context_length(target.config), context_length(draft.config))
    seq = prompt_tokens(input_ids, limit, target=target, draft=draft)
    target_cache, draft_cache = DynamicCache(), DynamicCache()
    cost = CostModel(max_depth=opts.max_depth) if opts.budget == "auto" else None

    def step(seq, rng, stats):
        return speculative_step(
            target, draft, target_cache, draft_cache, seq, opts, rng, stats, limit, cost
        )

    tokens, stats = decode_loop(
        step, seq, opts, limit, stop_tokens(eos_token_id, target), on_tokens
    )
    stats.cost_model = cost
    return tokens, stats


# ---- autoregressive baseline ----


@torch.no_grad()
def autoregressive(model, input_ids, *, eos_token_id=None, on_tokens=None, **options):
    """Plain decoding, one target pass per token, with the same sampling, stopping and Stats.

    The reference SpecExec is held against: at temperature 0 and with the same seed at
    any temperature, `generate` returns exactly these tokens.
    """
    from transformers import DynamicCache

    opts = Options(**options)
    limit = context_length(model.config)
    seq = prompt_tokens(input_ids, limit, model=model)
    cache = DynamicCache()

    def step(seq, rng, stats):
        with timer(stats, "time_target", model.device):
            trunk = seq[cache.get_seq_length() :]
            logits = tree_forward(model, cache, trunk, chain(len(trunk)))  # (len(trunk), vocab)
            check_finite(logits[-1], "target")
            return [choose(logits[-1], opts, rng)]

    return decode_loop(step, seq, opts, limit, stop_tokens(eos_token_id, model), on_tokens)


# ---- command line ----


def main(argv=None):
    """`python specexec.py --help`: the command line lives in cli.py, with model loading (and
    runs from the top of this file, before its imports)."""
    import cli

    cli.main(argv)
