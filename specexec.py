"""SpecExec: massively parallel speculative decoding, in one readable file.

Svirschevski et al., "SpecExec: Massively Parallel Speculative Decoding for Interactive LLM
Inference on Consumer Devices", arXiv 2406.02532.

The idea. When a big *target* model's weights stream from RAM or SSD for every forward pass,
a pass over a thousand tokens costs about as much as a pass over one. So a small *draft*
model grows a large tree of likely continuations, best-first by cumulative draft
probability, and keeps the `budget` most probable nodes. The target then scores the whole
tree in ONE pass, with an attention mask that lets each node see only its ancestors. We walk
the tree from the root, following the target's own pick at each node while that pick is a
child in the tree, and finish with the target's pick at the last node reached (the bonus
token). Every token is the target's own pick, so the output is exactly what the target alone
would produce: its greedy decoding at temperature 0, an exact sample otherwise.

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
    the target's next token at a node     pick          (argmax, or one exact sample)
    bonus token                           bonus
    one target forward pass               a step        (Stats.steps)

The sequence `seq` is the prompt plus every accepted token. The invariant that makes the
caches simple: after each step, each model's KV cache holds a prefix of `seq` that does not
include its last token (the root of the next tree); a model is always fed the part of `seq`
its cache lacks (the "trunk") before anything else. The first step's trunk is the prompt.
`speculative_step` checks the invariant at the end of every step.

Top-down, in the order a step runs: options -> sampling -> draft tree -> tree attention mask ->
verification and acceptance -> the step -> the loop -> the plain baseline -> what a run did;
plumbing last. The loop asks a policy for each step's budget and depth: a fixed one here, or
budget "auto" (specexec_tools/cost_model.py). Models are checked and loaded by
specexec_tools/models.py; `python specexec.py` is specexec_tools/cli.py.
"""

import heapq
import math
import numbers
import sys
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields

try:  # torch takes seconds to import: Ctrl-C meanwhile exits as it does later (130, quietly)
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from specexec_tools.models import CACHE, SpecExecError, attention_windows, preflight
except KeyboardInterrupt:
    sys.exit(130)

# ---- options ----


def option(default, help):
    """A config field and its help text (the CLI's `--help` shows it)."""
    return field(default=default, metadata={"help": help})


@dataclass
class Options:
    """Generation options: one source of defaults for `generate`, `autoregressive` and the CLI.
    Checked when made (`check_options`, at the end of this file)."""

    max_new_tokens: int = option(128, "stop after this many new tokens")
    budget: int | str = option(
        "auto",
        'draft tree size: nodes verified per step; "auto": the size and depth with the most '
        "tokens/s, chosen as it runs (specexec_tools/cost_model.py)",
    )
    max_depth: int = option(16, "max tree depth = draft passes per step (auto: at most this)")
    width: int = option(32, "beam width: nodes expanded per draft pass")
    branch: int = option(8, "children kept per expanded node")
    temperature: float = option(0.0, "0 = greedy (exact argmax)")
    top_p: float = option(1.0, "nucleus sampling mass (1 = off)")
    top_k: int = option(0, "sample from the k most likely (0 = off)")
    seed: int | None = option(None, "random seed for sampling (default: a fresh one)")
    draft_threads: int | None = option(
        None,
        "CPU threads for the draft's passes (default: 1 for a small draft, torch's setting for "
        "one of 50M parameters or more; 0: torch's setting); output is unchanged",
    )
    draft_temperature: float | None = option(
        None,
        "the draft's temperature when it ranks the tree (default: 0.3 when greedy, "
        "else the sampling temperature); output is unchanged",
    )

    def __post_init__(self):
        check_options(self)

    def tree_temperature(self):
        """The draft's temperature when it ranks tree nodes. The tree should hold the paths the
        target is most likely to follow: sampling at temperature t, the draft's path probability
        at t; greedy, a sharpened draft (0.3), as the target follows the draft's top choice more
        often than a flat draft's probability says (docs/results.md). Neither changes the output."""
        if self.draft_temperature is not None:
            return self.draft_temperature
        return self.temperature if self.temperature > 0 else 0.3


@dataclass
class Run:
    """One generation's state, carried from step to step: the models, their caches, the options
    and the random numbers the target's picks draw."""

    target: object  # any causal LM with Hugging Face's call signature (offload.py's too)
    draft: object | None  # None: plain decoding (`autoregressive`)
    opts: Options
    limit: int  # positions both models can use (the shorter context)
    rng: torch.Generator | None = None  # default: seeded with opts.seed
    target_cache: object = None  # a DynamicCache each, made empty by default
    draft_cache: object = None

    def __post_init__(self):
        from transformers import DynamicCache

        self.seed = self.opts.seed if self.opts.seed is not None else torch.seed()
        self.rng = torch.Generator().manual_seed(self.seed) if self.rng is None else self.rng
        self.target_cache = DynamicCache() if self.target_cache is None else self.target_cache
        if self.draft is not None and self.draft_cache is None:
            self.draft_cache = DynamicCache()


# ---- sampling ----


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


def pick(logits, opts, rng):
    """The target's pick: argmax at temperature 0, else one sample (one uniform draw)."""
    if opts.temperature == 0:
        return int(logits.argmax())
    probs = sampling_probs(logits, opts.temperature, opts.top_k, opts.top_p).cpu()  # (vocab,)
    cdf = probs.cumsum(0)  # (vocab,)
    u = torch.rand((), generator=rng, dtype=torch.float64) * cdf[-1]
    # The first token whose cdf exceeds u; zero-probability tokens can never be picked.
    return int(torch.searchsorted(cdf, u, right=True))


def check_finite(logits, role):
    """NaN or inf logits (broken weights, a negative rms_norm_eps) would pick token 0 or garbage
    and run on; checked once per pass, on the rows the pass's picks are made from. A NaN or inf
    anywhere makes the sum NaN or inf: one reduction, 20x cheaper than isfinite().all(), summed
    in float32 so that half-precision logits cannot overflow it."""
    if not math.isfinite(logits.sum(dtype=torch.float32)):
        raise SpecExecError(
            f"the {role} model computes logits that are not finite (NaN or inf): "
            "its weights or its config.json (e.g. rms_norm_eps) are broken"
        )


# ---- draft tree (priority queue) ----


@dataclass
class DraftTree:
    """Every node the draft discovered. Node 0 is the root: the last token of `seq`.

    Nodes are ranked by `rank`, best first. Two heaps hold (sort key, node): `candidates`, the
    nodes found but not yet fed to the draft, give up their best first (`pop_candidates`);
    `best_nodes`, the `budget` best found so far, give up their worst first, to a better
    newcomer (`admit`). The node is each entry's last item.
    """

    tokens: list  # token of each node
    parents: list  # parent node of each node; -1 for the root
    cum_logprob: list  # draft log-probability of the path from the root (root: 0)
    depth: list  # edges from the root (root: 0)
    budget: int  # how many nodes (besides the root) the target will verify
    candidates: list = field(default_factory=list)  # heap of (rank, node): best on top
    best_nodes: list = field(default_factory=list)  # heap of (worst_first, node): worst on top
    fed: list = field(default_factory=list)  # nodes (not the root) in the draft's cache, in order
    draft_passes: int = 0  # passes that grew it (the first feeds the trunk too)

    def rank(self, node):
        """Sorts nodes best first: higher cum_logprob; on a tie the earlier node, so parents
        come before their children."""
        return (-self.cum_logprob[node], node)

    def worst_first(self, node):
        """Sorts nodes worst first: the rank, reversed."""
        return (self.cum_logprob[node], -node)

    def add_children(self, nodes, logprobs, branch):
        """Add each node's `branch` most probable children, as candidates and to the best nodes.

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
                # A node that cannot enter the best nodes never will (they only get better),
                # nor will its children (they rank below it): it is no candidate either.
                if self.admit(child):
                    heapq.heappush(self.candidates, (self.rank(child), child))

    def admit(self, node):
        """Put `node` among the best nodes, pushing out the worst once there are `budget`;
        whether it stays (False: it was the worst itself)."""
        entry = (self.worst_first(node), node)
        if len(self.best_nodes) < self.budget:
            heapq.heappush(self.best_nodes, entry)
            return True
        return heapq.heappushpop(self.best_nodes, entry) != entry

    def pop_candidates(self, width):
        """Up to `width` candidates, best first, that may still give a best node.

        Once there are `budget` best nodes, a candidate ranked below the worst of them is
        worth nothing: its children would rank below it, and the best nodes only get better.
        """
        full = len(self.best_nodes) == self.budget
        worst = self.rank(self.best_nodes[0][-1]) if full else None
        batch = []
        while self.candidates and len(batch) < width:
            if full and self.candidates[0][0] >= worst:
                break
            batch.append(heapq.heappop(self.candidates)[-1])
        return batch

    def best(self):
        """The `budget` most probable nodes except the root, parents before children: the nodes
        the target verifies.

        This set is always a tree (closed under ancestors): a child's path is its parent's
        path times one more probability <= 1, so the child never ranks above its parent,
        and ties go to the earlier node, which the parent is.
        """
        return sorted(node for _, node in self.best_nodes)

    def local_parents(self, nodes):
        """Each node's parent as an index into `nodes` (-1: the root), as `tree_mask` takes them.

        `nodes` lists parents before children and is closed under ancestors, but for the root.
        """
        index = {0: -1} | {node: i for i, node in enumerate(nodes)}
        return [index[self.parents[node]] for node in nodes]


def grow_tree(run, seq, budget, max_depth):
    """Best-first search for the `budget` most probable continuations of `seq`.

    A heap holds the candidates: nodes discovered but not yet fed to the draft. Each draft
    pass takes the `width` best of them, runs them in one tree-masked batch (reusing the
    cache of the prefix and of all nodes fed before), and pushes each one's `branch` best
    children. Passes per tree are bounded by the depth, whatever the budget: `max_depth`, less
    near the end of the context (`run.limit` positions).
    """
    draft, cache, opts = run.draft, run.draft_cache, run.opts
    # Pass 1: feed the trunk (what the draft's cache lacks, ending with the root).
    trunk = seq[cache.get_seq_length() :]
    if max(trunk) >= draft.config.vocab_size:  # the prompt was checked, the target's picks not
        raise SpecExecError(f"the target chose token id {max(trunk)}, which the draft lacks")
    logits = tree_forward(draft, cache, trunk, chain(len(trunk)), keep=1)  # (1, vocab)
    tree = DraftTree(tokens=[seq[-1]], parents=[-1], cum_logprob=[0.0], depth=[0], budget=budget)
    tree.draft_passes = 1
    temperature = opts.tree_temperature()
    logprobs = torch.log_softmax(logits[-1:].float() / temperature, -1)  # (1, vocab)
    tree.add_children([0], logprobs, opts.branch)

    # Tree nodes at depth d sit at position len(seq) - 1 + d, which must fit the context.
    for _ in range(min(max_depth, run.limit - len(seq)) - 1):
        batch = tree.pop_candidates(opts.width)
        if not batch:
            break
        parents = tree.local_parents(tree.fed + batch)  # the fed nodes are in the cache
        logits = tree_forward(draft, cache, [tree.tokens[node] for node in batch], parents)
        tree.draft_passes += 1
        tree.fed += batch
        logprobs = torch.log_softmax(logits.float() / temperature, -1)  # (len(batch), vocab)
        tree.add_children(batch, logprobs, opts.branch)
    return tree


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


def tree_mask_reference(parents, n_cached, dtype, device, window=None):
    """`tree_mask` built plainly, one token at a time, to hold the fast one against (tests).

    Each token climbs from itself to the root and unmasks what it passes, then every cached
    token; with a sliding `window`, only those fewer than `window` positions back.
    """
    positions = []  # each token's position: one below its parent's (parents come first)
    for parent in parents:
        positions.append(n_cached if parent < 0 else positions[parent] + 1)
    key_positions = list(range(n_cached)) + positions  # (n_cached + n,)
    mask = torch.full((len(parents), n_cached + len(parents)), torch.finfo(dtype).min, dtype=dtype)
    for i in range(len(parents)):
        visible, node = list(range(n_cached)), i
        while node >= 0:
            visible.append(n_cached + node)
            node = parents[node]
        for j in visible:
            if window is None or positions[i] - key_positions[j] < window:
                mask[i, j] = 0.0
    return mask[None, None].to(device), torch.tensor([positions], device=device)


def chain(n):
    """Parents of n tokens in a row (a causal mask)."""
    return list(range(-1, n - 1))


# The attention kernels a pass on a GPU may use: all of torch's but cuDNN's, which plans a graph
# for each new shape of query, keys and mask, and here every pass's shape is new (the tree, the
# cache's length). On an H100 a float16 draft got it: 60 ms a pass, 3 ms for a shape planned.
ATTENTION_KERNELS = [k for name, k in SDPBackend.__members__.items() if "CUDNN" not in name]
ATTENTION_KERNELS.remove(SDPBackend.ERROR)


def tree_forward(model, cache, tokens, parents, keep=0):
    """Run new `tokens` after the cache, as the last nodes of the tree `parents`; the logits of
    the last `keep` of them (0: all). A prompt's rows are never read: the head over them would
    cost as much as a few layers (a 49k-token vocabulary) and its logits hundreds of MB.

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
    on_gpu = model.device.type == "cuda"  # (entering sdpa_kernel costs 32 us: a GPU's alone)
    with sdpa_kernel(ATTENTION_KERNELS) if on_gpu else nullcontext():
        out = model(
            input_ids=input_ids,
            attention_mask=masks.get(None, masks),  # one for all layers, or a dict by layer type
            position_ids=positions,  # (1, n)
            **{CACHE: cache},  # past_key_values= before transformers 5.24
            use_cache=True,
            logits_to_keep=keep,
        )
    return out.logits[0]  # (keep or n, vocab)


# ---- verification and acceptance ----


def verify(target, cache, seq, tree, nodes):
    """ONE target pass over the trunk and the tree's `nodes`; logits at the root and each node."""
    trunk = seq[cache.get_seq_length() :]  # usually just the root; the whole prompt at first
    # After the trunk, local parent -1 (the root) lands on the trunk's last token.
    parents = chain(len(trunk)) + [len(trunk) + i for i in tree.local_parents(nodes)]
    tokens = trunk + [tree.tokens[node] for node in nodes]
    return tree_forward(target, cache, tokens, parents, keep=1 + len(nodes))  # root, then nodes


def accept(tree, nodes, logits, opts, rng):
    """Follow the target's own picks down the tree; return the accepted nodes and the bonus.

    At each node the target picks the next token from its own distribution. If that token
    is a child among the verified `nodes` we move there for free; if not, the pick itself is
    the bonus token. Every emitted token is thus the target's pick given everything before it,
    so the output is the target's greedy decoding (temperature 0) or an exact sample from it.
    """
    row = {node: i for i, node in enumerate([0] + nodes)}  # each node's row of `logits`
    child = {(tree.parents[node], tree.tokens[node]): node for node in nodes}
    path, node = [], 0
    while True:
        token = pick(logits[row[node]], opts, rng)  # one uniform draw per visited node
        if (node, token) not in child:
            check_finite(logits[[row[visited] for visited in [0, *path]]], "target")
            return path, token
        node = child[(node, token)]
        path.append(node)


def keep_path(cache, nodes, path):
    """Drop the tree from the cache but for `path`.

    The cache ends with one entry per node of `nodes`, in order; what precedes them stays,
    as do the entries of `path`'s nodes (those the cache holds). `DynamicCache.crop` can only
    drop a suffix, and the path is scattered among the tree's entries, so we move the path's
    entries up to just after the prefix, then drop everything after them. The prefix is not
    copied: a step's cost must not grow with the context (a plain step drops nothing).
    """
    n_prefix = cache.get_seq_length() - len(nodes)
    position = {node: n_prefix + i for i, node in enumerate(nodes)}
    kept = [position[node] for node in path if node in position]  # in order, each >= its slot
    n_keep = n_prefix + len(kept)
    moved = kept != list(range(n_prefix, n_keep))  # a path at the front is in place already
    for layer in cache.layers:
        for name in ("keys", "values"):  # each (1, heads, n_prefix + len(nodes), head_dim)
            tensor = getattr(layer, name)
            if moved:  # gathered first, then written: sources never lie before their slots
                index = torch.tensor(kept, dtype=torch.long, device=tensor.device)  # (n_path,)
                tensor[..., n_prefix:n_keep, :] = tensor.index_select(-2, index)
            setattr(layer, name, tensor[..., :n_keep, :])  # (1, heads, n_keep, head_dim)


# ---- the step ----


@dataclass
class Step:
    """What one step did: the loop hands it to the policy and to Stats, nothing else."""

    tokens: list  # the tokens it emitted: the accepted path's, then the bonus
    budget: int  # the budget it was given; 0: a plain step, no tree
    depth: int  # the depth limit it was given
    n_fed: int  # tokens its target pass read: the trunk and the tree
    tree: DraftTree | None = None
    path: list = field(default_factory=list)  # the accepted tree nodes
    draft_passes: int = 0
    draft_s: float = 0.0  # seconds growing the tree
    target_s: float = 0.0  # seconds of the target pass and acceptance
    total_s: float = 0.0  # seconds of the whole step

    @property
    def tree_size(self):
        return len(self.tree.best_nodes) if self.tree else 0

    @property
    def tree_depth(self):
        """How deep the verified tree went (never deeper than its budget)."""
        if self.tree is None:
            return 0
        return max((self.tree.depth[node] for node in self.tree.best()), default=0)


def speculative_step(run, seq, budget, max_depth):
    """One SpecExec step: draft tree, ONE target pass, acceptance, both caches cut to the path.
    Returns a `Step`; its tokens are the accepted path's and the bonus."""
    start = time.perf_counter()
    with timer(run.draft.device) as draft_s, cpu_threads(draft_threads(run), run.draft.device):
        tree = grow_tree(run, seq, budget, max_depth)
        nodes = tree.best()
    n_fed = len(seq) - run.target_cache.get_seq_length() + len(nodes)  # trunk and tree
    with timer(run.target.device) as target_s:
        logits = verify(run.target, run.target_cache, seq, tree, nodes)  # (1 + len(nodes), vocab)
        path, bonus = accept(tree, nodes, logits, run.opts, run.rng)

    # Both caches now hold all of `seq`, then tree nodes: the target's the verified ones, the
    # draft's the fed ones. Keep `seq` plus the accepted path; the bonus is the next root,
    # seen by neither. The path's last node may be a leaf the draft never fed: it is then
    # part of the draft's trunk at the next step.
    keep_path(run.target_cache, nodes, path)
    keep_path(run.draft_cache, tree.fed, path)
    # The invariant: the target's cache holds the new `seq` but its last token (the bonus),
    # the draft's that too, or all but the path's last node if it never fed it.
    n_seen = len(seq) + len(path)
    lengths = run.draft_cache.get_seq_length(), run.target_cache.get_seq_length()
    assert n_seen - 1 <= lengths[0] <= lengths[1] == n_seen, f"cache lengths {lengths}, {n_seen}"

    tokens = [tree.tokens[node] for node in path] + [bonus]
    return Step(
        tokens, budget, max_depth, n_fed, tree, path, tree.draft_passes,
        draft_s(), target_s(), time.perf_counter() - start,
    )  # fmt: skip


def plain_step(run, seq, budget=0, max_depth=0):
    """One target pass over what its cache lacks, and the target's pick: plain decoding (the
    baseline, and budget auto's step where no tree pays). The draft's cache, if any, waits:
    its next tree's trunk catches it up."""
    start = time.perf_counter()
    with timer(run.target.device) as target_s:
        trunk = seq[run.target_cache.get_seq_length() :]
        logits = tree_forward(run.target, run.target_cache, trunk, chain(len(trunk)), keep=1)
        check_finite(logits[-1], "target")  # logits: (1, vocab)
        tokens = [pick(logits[-1], run.opts, run.rng)]
    return Step(tokens, 0, 0, len(trunk), target_s=target_s(), total_s=time.perf_counter() - start)


# ---- the loop ----


@dataclass
class FixedBudget:
    """The policy of a fixed budget: every step the same (budget, depth); budget 0 is plain
    decoding. Budget "auto" is specexec_tools/cost_model.py's CostModel, with the same two
    methods: `choose` before each step, `update` with what the step did."""

    budget: int
    depth: int
    why: str = ""  # for the summary: why a run with a draft decodes plainly

    def choose(self, left=None):  # left: tokens still to come (auto's looks heed them)
        return self.budget, self.depth

    def update(self, step):
        pass


def make_policy(opts, target, draft):
    """The policy `opts.budget` names: a fixed budget, or "auto"; with no draft, plain decoding.

    Auto decodes plainly from the first step where no tree can pay, which it would otherwise
    learn only from a first tree (the draft reads the prompt, then searches): the draft
    is an int8 / int4 model at least the target's size, such as the target's own copy
    (offload.self_draft: its pass is the target's, over the weights dequantized), and the
    target's weights stay put, so d draft passes cost about d target passes, for at most d + 1
    tokens. Beside a streamed target that copy pays."""
    if draft is None:
        return FixedBudget(0, 0)
    if opts.budget != "auto":
        return FixedBudget(opts.budget, opts.max_depth)
    quantized, streamed = getattr(draft, "quantized", None), streams(target)
    if quantized and weights(draft) >= weights(target) and not streamed:
        why = f"its {quantized} draft is the target's size and costs what the target does"
        return FixedBudget(0, 0, why=f"auto decoded plainly: {why} (no tree can pay)")
    from specexec_tools.cost_model import CostModel

    # The first tree, chosen before anything is measured: where the target streams its weights,
    # as big as a pass carries for about the cost of one token's; where they stay put, a small
    # one, since there a tree's pass costs compute, and the draft must read the prompt too
    first = dict(budget=32, first_depth=4) if streamed else dict(budget=8, first_depth=2)
    return CostModel(max_depth=opts.max_depth, **first)


def streams(model):
    """Whether a pass moves the model's weights: an offloaded model streaming layers (offload.py),
    or a Hugging Face model that accelerate's device_map spreads to disk, or to host memory
    beside a GPU."""
    if hasattr(model, "streams"):
        return model.streams
    places = {str(place) for place in getattr(model, "hf_device_map", {}).values()}
    return "disk" in places or ("cpu" in places and len(places) > 1)


def weights(model):
    """About how many weights a pass of the model reads, from its config (attention and MLP of
    a dense decoder, the embeddings): an offloaded model holds its layers outside
    `parameters()`."""
    c = model.config
    return 12 * c.hidden_size**2 * c.num_hidden_layers + c.vocab_size * c.hidden_size


def decode_loop(run, seq, policy, eos, on_tokens):
    """The loop shared by SpecExec and the baseline: ask the policy for a budget, step, tell it
    what the step did, until max_new_tokens, the context or an EOS."""
    stats, new_tokens = Stats(policy=policy, threads=torch.get_num_threads()), []
    stats.seed = run.seed if run.opts.temperature > 0 else None  # the one that reproduces it
    start = time.perf_counter()
    while len(new_tokens) < run.opts.max_new_tokens and len(seq) < run.limit:
        left = min(run.opts.max_new_tokens - len(new_tokens), run.limit - len(seq))
        budget, depth = policy.choose(left)
        step = (speculative_step if budget else plain_step)(run, seq, budget, depth)
        policy.update(step)
        # Cut at the token limit, the context, and just after the first EOS.
        tokens = step.tokens[:left]
        ends = [i for i, t in enumerate(tokens) if t in eos]
        tokens = tokens[: ends[0] + 1] if ends else tokens
        stats.add(step, len(tokens))
        seq += tokens
        new_tokens += tokens
        if on_tokens is not None:
            on_tokens(tokens)
        if ends:
            break
    stats.time_total = time.perf_counter() - start
    return new_tokens, stats


@torch.no_grad()
def generate(target, draft, input_ids, *, eos_token_id=None, on_tokens=None, opts=None, **options):
    """SpecExec decoding. Returns (new_tokens, Stats); the target alone would emit the same.

    input_ids: list of ints or a LongTensor (1, n). opts: an `Options`, or its fields as
    keyword arguments. eos_token_id: an int or a list; by default the target's generation
    config's; [] = none. on_tokens(list[int]) is called with each step's accepted tokens
    (for streaming).
    """
    opts = as_options(opts, options, on_tokens)
    seq, limit, eos = preflight(target, draft, input_ids, eos_token_id)
    run = Run(target, draft, opts, limit)
    return decode_loop(run, seq, make_policy(opts, target, draft), eos, on_tokens)


# ---- the plain baseline ----


@torch.no_grad()
def autoregressive(model, input_ids, *, eos_token_id=None, on_tokens=None, opts=None, **options):
    """Plain decoding, one target pass per token, with the same sampling, stopping and Stats.

    The reference SpecExec is held against: at temperature 0 and with the same seed at
    any temperature, `generate` returns exactly these tokens.
    """
    opts = as_options(opts, options, on_tokens)
    seq, limit, eos = preflight(model, None, input_ids, eos_token_id)
    return decode_loop(Run(model, None, opts, limit), seq, FixedBudget(0, 0), eos, on_tokens)


# ---- a conversation: the caches kept from turn to turn ----


class Chat:
    """`generate` again and again on a growing prompt (a conversation, each turn rendered whole),
    with both caches and the budget policy (auto's cost model) kept from turn to turn.

    A turn reuses what the caches hold as far as it matches the new prompt token for token (a
    chat template may render earlier turns anew), drops the rest, and feeds the models only what
    their caches lack: the answer is exactly `generate`'s on the whole prompt, from empty caches.
    With draft None it decodes plainly, as `autoregressive` does."""

    def __init__(self, target, draft, opts=None, **options):
        self.target, self.draft, self.opts = target, draft, as_options(opts, options, None)
        self.policy = make_policy(self.opts, target, draft)
        self.seq = []  # the tokens the caches were last left holding, but the last
        self.caches = None  # (target's, draft's); made by the first turn's Run

    @torch.no_grad()
    def generate(self, input_ids, *, eos_token_id=None, on_tokens=None):
        """One turn: `input_ids` is the whole conversation so far. Returns (new_tokens, Stats);
        `stats.reused` counts the prompt tokens the target's cache already held."""
        opts = as_options(self.opts, {}, on_tokens)
        seq, limit, eos = preflight(self.target, self.draft, input_ids, eos_token_id)
        # Keep the longest prefix of what the caches hold (self.seq but its last token) that the
        # new prompt shares, leaving the prompt's last token out: the first tree's root.
        held = self.seq[:-1]
        shared = next((i for i, (a, b) in enumerate(zip(held, seq)) if a != b), len(held))
        reused = min(shared, len(seq) - 1)
        run = Run(self.target, self.draft, opts, limit)  # its rng seeded anew: as a fresh run
        if self.caches is not None:
            run.target_cache, run.draft_cache = self.caches
            for cache in self.caches:
                crop(cache, reused)
        self.caches = run.target_cache, run.draft_cache
        new_tokens, stats = decode_loop(run, seq, self.policy, eos, on_tokens)
        # The caches may hold tokens past a stop (an EOS inside an accepted path): cut them, so
        # that they hold `seq` but its last token, as after any step.
        for cache in self.caches:
            crop(cache, len(seq) - 1)
        self.seq, stats.reused = seq, reused
        return new_tokens, stats


def crop(cache, n):
    """Keep at most the first n entries of every layer's keys and values (None: no cache)."""
    if cache is None or cache.get_seq_length() <= n:
        return
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]


# ---- what a run did ----


@dataclass
class Stats:
    """What a run did, added up from its steps in one place (`add`). `steps` counts target
    forward passes."""

    steps: int = 0
    new_tokens: int = 0
    draft_passes: int = 0
    emitted: list = field(default_factory=list)  # tokens per step: accepted path + bonus
    tree_sizes: list = field(default_factory=list)  # nodes verified per step
    tree_depths: list = field(default_factory=list)  # how deep the verified tree went
    budgets: list = field(default_factory=list)  # (budget, depth) each step was given
    policy: object = None  # what sized the steps: FixedBudget, or auto's CostModel
    threads: int = 0  # CPU threads of the target's passes
    seed: int | None = None  # sampling's: the run is reproduced with it
    reused: int | None = None  # a Chat's turn: prompt tokens the target's cache held already
    time_draft: float = 0.0
    time_target: float = 0.0
    time_total: float = 0.0

    def add(self, step, n_emitted):
        """One step, of which `n_emitted` tokens were kept (the rest lay past a stop)."""
        self.steps += 1
        self.new_tokens += n_emitted
        self.draft_passes += step.draft_passes
        self.emitted.append(n_emitted)
        self.tree_sizes.append(step.tree_size)
        self.tree_depths.append(step.tree_depth)
        self.budgets.append((step.budget, step.depth))
        self.time_draft += step.draft_s
        self.time_target += step.target_s

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
        return dict(sorted(Counter(self.emitted).items()))

    def summary(self):
        """One line: what was made, per target pass and per second, where the time went, and
        the trees it verified (the summary's one place)."""
        line = (
            f"{count(self.new_tokens, 'token')} in {count(self.steps, 'target pass')} "
            f"({self.tokens_per_step:.2f} per pass), {self.tokens_per_second:.3g} tokens/s; "
            f"draft {self.time_draft:.2f}s, target {self.time_target:.2f}s, "
            f"other {self.time_other:.2f}s"
        )
        trees = [budget for budget, _ in self.budgets if budget]
        if trees:  # SpecExec, not the baseline
            budget, n = Counter(trees).most_common(1)[0]
            deepest = max(d for (b, _), d in zip(self.budgets, self.tree_depths) if b == budget)
            some = f" in {n} of {len(self.budgets)} steps" if len(set(trees)) > 1 else ""
            line += f"; budget {budget}{some}, trees up to {deepest} deep"
            if len(trees) < len(self.budgets):
                plain = count(len(self.budgets) - len(trees), "step")
                line += f"; plain decoding (no tree) in {plain}"
            line += f"; {self.draft_passes / self.steps:.1f} draft passes per target pass"
        line += f"; {self.policy.why}" if getattr(self.policy, "why", "") else ""
        line += f"; threads {self.threads}" if self.threads else ""
        line += f"; seed {self.seed}" if self.seed is not None else ""
        return line + (
            f"; {count(self.reused, 'token')} reused from the caches" if self.reused else ""
        )


def count(n, one):
    """'1 token', '2 tokens', '3 target passes'."""
    return f"{n} {one if n == 1 else one + ('es' if one.endswith('s') else 's')}"


# ---- plumbing: options checked, timers, threads, the command line ----


def as_options(opts, options, on_tokens):
    """`opts`, or an Options of the keyword arguments (not both); on_tokens callable."""
    if opts is not None and options:
        raise SpecExecError(f"pass opts= or options ({', '.join(options)}), not both")
    if opts is not None and not isinstance(opts, Options):
        raise SpecExecError(f"opts must be a specexec.Options, got {type(opts).__name__}")
    if on_tokens is not None and not callable(on_tokens):
        raise SpecExecError(f"on_tokens must be a function of a list of tokens, got {on_tokens!r}")
    return opts if opts is not None else Options(**options)


@contextmanager
def timer(device):
    """Time a block; yields a function that gives its seconds once it ends. On a GPU it waits
    for the device's current stream, so that the split between draft and target is true."""
    device = torch.device(device)
    if device.type == "cuda":
        sync = torch.cuda.current_stream(device).synchronize
    else:
        sync = lambda: None
    sync()
    seconds = []
    start = time.perf_counter()
    yield lambda: seconds[0]
    sync()
    seconds.append(time.perf_counter() - start)


def draft_threads(run):
    """The draft's CPU threads: as given; by default one for a small draft, whose pass is a few
    small matmuls that more threads only slow down on a busy CPU (docs/results.md), and torch's
    setting (0) for a big one (a real model's layers, the target's own int4 copy)."""
    if run.opts.draft_threads is not None:
        return run.opts.draft_threads
    return 1 if weights(run.draft) < 50e6 else 0


@contextmanager
def cpu_threads(n, device):
    """Run a block on `n` CPU threads (0 or None, or a GPU: as it is). A draft pass is a few
    small matmuls: more threads do not make it faster, and on a busy CPU they wait for each
    other (docs/results.md measures it)."""
    before = torch.get_num_threads()
    if n and torch.device(device).type == "cpu":
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_options(opts):
    """Each option's type and range, in one line naming it (`Options` calls this when made);
    then each number as Python's own int or float (numpy's and Fraction would fail deep in
    torch)."""
    for f in fields(opts):
        value, integer = getattr(opts, f.name), f.type in (int, int | str, int | None)
        if f.name == "budget" and value == "auto":
            continue
        kind = numbers.Integral if integer else numbers.Real  # a bool is no count
        if (value is not None or f.default is not None) and (
            isinstance(value, bool) or not isinstance(value, kind)
        ):
            kind = "an integer" if integer else "a number"
            kind += ' or "auto"' if f.name == "budget" else ""
            raise SpecExecError(f"{f.name} must be {kind}, got {value!r}")
        if value is not None:
            setattr(opts, f.name, int(value) if integer else float(value))
    counts = ("budget", "max_depth", "width", "branch")
    lowest = dict.fromkeys(counts, 1) | dict(max_new_tokens=0, top_k=0, draft_threads=0)
    for name, least in lowest.items():
        if getattr(opts, name) not in ("auto", None) and getattr(opts, name) < least:
            raise SpecExecError(f"{name} must be at least {least}, got {getattr(opts, name)}")
    # A floor: logits / temperature stays finite for any float32 logit (3.4e38 / 1e-4 fits
    # a float64), and below 1e-4 sampling is greedy decoding in all but exact ties anyway.
    if not (opts.temperature == 0 or 1e-4 <= opts.temperature < math.inf):
        raise SpecExecError(f"temperature must be 0 or in [1e-4, inf), got {opts.temperature}")
    if not 0 < opts.top_p <= 1:
        raise SpecExecError(f"top_p must be in (0, 1], got {opts.top_p}")
    if opts.seed is not None and not 0 <= opts.seed < 2**64:
        raise SpecExecError(f"seed must be in [0, 2**64), got {opts.seed}")
    if opts.draft_temperature is not None and not 1e-2 <= opts.draft_temperature < math.inf:
        raise SpecExecError(
            f"draft_temperature must be in [0.01, inf), got {opts.draft_temperature}"
        )


if __name__ == "__main__":  # `python specexec.py`: the command line, specexec_tools/cli.py
    sys.modules["specexec"] = sys.modules["__main__"]  # this file is `specexec` there: read once
    from specexec_tools import cli

    cli.main()
