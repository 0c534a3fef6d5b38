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

This file, top-down in the order a step runs: config (Options, Stats, and Run, a generation's
state) -> sampling -> draft tree -> tree attention mask -> verification and acceptance -> the
step -> the loop -> the plain-decoding baseline. Beside it: checks.py (what a user hands in),
cost_model.py (budget "auto": the b and d that maximise E[tokens](b, d) / (d * t_draft +
t_target(b + 1) + t_other)), families.py (which models a tree pass runs, and their windows).
"""

if __name__ == "__main__":  # `python specexec.py`: the command line, before the slow imports below
    import cli  # (it imports this file as `specexec`, and exits quietly on Ctrl-C meanwhile)

    cli.main()
    raise SystemExit

import heapq
import math
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from checks import (  # what a user hands in, each refused in one line (SpecExecError)
    SpecExecError,
    check_draft_vocab,
    check_options,
    context_length,
    prompt_tokens,
    stop_tokens,
)
from cost_model import CostModel  # budget "auto": the tree size with the most tokens/s
from families import CACHE, attention_windows  # the cache's keyword; each layer's reach

# ---- config ----


def option(default, help):
    """A config field and its help text (the CLI's `--help` shows it)."""
    return field(default=default, metadata={"help": help})


@dataclass
class Options:
    """Generation options: one source of defaults for `generate`, `autoregressive` and the CLI.
    Checked when made (checks.check_options)."""

    max_new_tokens: int = option(128, "stop after this many new tokens")
    budget: int | str = option(
        "auto",
        'draft tree size: nodes verified per step; "auto": the size and depth with the most '
        "tokens/s, chosen as it runs (cost_model.py)",
    )
    max_depth: int = option(16, "max tree depth = draft passes per step (auto: at most this)")
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
        check_options(self)

    def tree_temperature(self):
        """The draft's temperature when it ranks tree nodes. The tree should hold the paths the
        target is most likely to follow. Sampling at temperature t, that is the draft's path
        probability at t. Greedy, the target follows the draft's top choice more often than a
        flat draft's probability says, so a sharpened draft (0.3) ranks paths better and grows
        deeper trees (docs/results.md measures it). Neither changes what is emitted."""
        if self.draft_temperature is not None:
            return self.draft_temperature
        return self.temperature if self.temperature > 0 else 0.3


@dataclass
class Stats:
    """What a run did. `steps` counts target forward passes."""

    steps: int = 0
    new_tokens: int = 0
    draft_passes: int = 0
    emitted: list = field(default_factory=list)  # tokens per step: accepted path + bonus
    tree_sizes: list = field(default_factory=list)  # nodes verified per step
    choices: list = field(default_factory=list)  # (budget, depth) per step; budget 0: no tree
    cost_model: CostModel | None = None  # budget "auto": what it measured and predicted
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
        return dict(sorted(Counter(self.emitted).items()))

    def summary(self):
        """One line: what was made, per target pass and per second, and where the time went."""

        def count(n, one, many):  # "1 token", "2 tokens"
            return f"{n} {one if n == 1 else many}"

        line = (
            f"{count(self.new_tokens, 'token', 'tokens')} in "
            f"{count(self.steps, 'target pass', 'target passes')} "
            f"({self.tokens_per_step:.2f} per pass), "
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
            plain = count(len(self.choices) - len(trees), "step", "steps")
            line += f"; plain decoding (no tree) in {plain}"
        return line


@dataclass
class Run:
    """One generation's state, carried from step to step: the models, their caches, the
    options, the random numbers the target's choices draw and what the run did so far."""

    target: object  # any causal LM with Hugging Face's call signature (offload.py's too)
    draft: object | None  # None: plain decoding (`autoregressive`)
    opts: Options
    limit: int  # positions both models can use (the shorter context)
    rng: torch.Generator | None = None  # default: seeded with opts.seed
    stats: Stats = field(default_factory=Stats)
    target_cache: object = None  # a DynamicCache each, made empty by default
    draft_cache: object = None
    cost: CostModel | None = None  # budget "auto": made by default

    def __post_init__(self):
        from transformers import DynamicCache

        seed = self.opts.seed if self.opts.seed is not None else torch.seed()
        self.rng = torch.Generator().manual_seed(seed) if self.rng is None else self.rng
        self.target_cache = DynamicCache() if self.target_cache is None else self.target_cache
        if self.draft is not None and self.draft_cache is None:
            self.draft_cache = DynamicCache()
        if self.opts.budget == "auto" and self.cost is None:
            self.stats.cost_model = self.cost = CostModel(max_depth=self.opts.max_depth)


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
    before = torch.get_num_threads()
    if n is not None and torch.device(device).type == "cpu":
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


# ---- draft tree (priority queue) ----


@dataclass
class DraftTree:
    """Every node the draft discovered. Node 0 is the root: the last token of `seq`.

    Nodes are ranked by `rank`, best first. Two heaps hold ranks: `candidates`, the nodes found
    but not yet fed to the draft, give up their best first (`pop_candidates`); `best_nodes`,
    the `budget` best found so far, give up their worst first, to a better newcomer (`keep`).
    """

    tokens: list  # token of each node
    parents: list  # parent node of each node; -1 for the root
    cum_logprob: list  # draft log-probability of the path from the root (root: 0)
    depth: list  # edges from the root (root: 0)
    budget: int  # how many nodes (besides the root) the target will verify
    candidates: list = field(default_factory=list)  # heap of rank(node): best on top
    best_nodes: list = field(default_factory=list)  # heap of worst_first(node): worst on top
    fed: list = field(default_factory=list)  # nodes (not the root) in the draft's cache, in order

    def rank(self, node):
        """Sorts nodes best first: higher cum_logprob; on a tie the earlier node, so parents
        come before their children."""
        return (-self.cum_logprob[node], node)

    def worst_first(self, node):
        """Sorts nodes worst first: the rank, negated."""
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
                if self.keep(child):
                    heapq.heappush(self.candidates, self.rank(child))

    def keep(self, node):
        """Put `node` among the best nodes, pushing out the worst once there are `budget`;
        whether it stays (False: it was the worst itself)."""
        if len(self.best_nodes) < self.budget:
            heapq.heappush(self.best_nodes, self.worst_first(node))
            return True
        return heapq.heappushpop(self.best_nodes, self.worst_first(node)) != self.worst_first(node)

    def pop_candidates(self, width):
        """Up to `width` candidates, best first, that may still give a best node.

        Once there are `budget` best nodes, a candidate ranked below the worst of them is
        worth nothing: its children would rank below it, and the best nodes only get better.
        """
        full = len(self.best_nodes) == self.budget
        worst = (-self.best_nodes[0][0], -self.best_nodes[0][1]) if full else None  # its rank
        batch = []
        while self.candidates and len(batch) < width:
            if full and self.candidates[0] >= worst:
                break
            batch.append(heapq.heappop(self.candidates)[1])
        return batch

    def best(self):
        """The `budget` most probable nodes except the root, parents before children.

        This set is always a tree (closed under ancestors): a child's path is its parent's
        path times one more probability <= 1, so the child never ranks above its parent,
        and ties go to the earlier node, which the parent is.
        """
        return sorted(-negated_node for _, negated_node in self.best_nodes)

    def local_parents(self, nodes):
        """Each node's parent as an index into `nodes` (-1: the root), as `tree_mask` takes them.

        `nodes` lists parents before children and is closed under ancestors, but for the root.
        """
        index = {0: -1} | {node: i for i, node in enumerate(nodes)}
        return [index[self.parents[node]] for node in nodes]


def grow_tree(run, seq, budget=None, max_depth=None):
    """Best-first search for the `budget` most probable continuations of `seq`.

    A heap holds the candidates: nodes discovered but not yet fed to the draft. Each draft
    pass takes the `width` best of them, runs them in one tree-masked batch (reusing the
    cache of the prefix and of all nodes fed before), and pushes each one's `branch` best
    children. Passes per tree are bounded by the depth, whatever the budget: `max_depth`, less
    near the end of the context (`run.limit` positions). Both default to `run.opts`'.
    """
    draft, cache, opts = run.draft, run.draft_cache, run.opts
    budget = opts.budget if budget is None else budget
    max_depth = opts.max_depth if max_depth is None else max_depth
    # Pass 1: feed the trunk (what the draft's cache lacks, ending with the root).
    trunk = seq[cache.get_seq_length() :]
    if max(trunk) >= draft.config.vocab_size:  # the prompt was checked, the target's picks not
        raise SpecExecError(f"the target chose token id {max(trunk)}, which the draft lacks")
    logits = tree_forward(draft, cache, trunk, chain(len(trunk)))  # (len(trunk), vocab)
    run.stats.draft_passes += 1
    tree = DraftTree(tokens=[seq[-1]], parents=[-1], cum_logprob=[0.0], depth=[0], budget=budget)
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
        run.stats.draft_passes += 1
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
        **{CACHE: cache},  # past_key_values= before transformers 5.24
        use_cache=True,
    )
    return out.logits[0]  # (n, vocab)


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


def speculative_step(run, seq):
    """One SpecExec step: draft tree, one target pass, acceptance, cache update; new tokens.

    With a cost model (budget "auto"), the step's budget and depth are its choice, and budget 0
    is plain decoding: no tree, no draft pass (the draft's cache then lags behind `seq`, and
    its next tree's trunk catches it up).
    """
    stats, started = run.stats, (time.perf_counter(), replace(run.stats))  # a copy, for auto
    budget, depth = run.cost.choose() if run.cost else (run.opts.budget, run.opts.max_depth)
    with (
        timer(stats, "time_draft", run.draft.device),
        cpu_threads(run.opts.draft_threads, run.draft.device),
    ):
        if budget:
            tree = grow_tree(run, seq, budget, depth)
        else:
            tree = DraftTree(tokens=[seq[-1]], parents=[-1], cum_logprob=[0.0], depth=[0], budget=0)
        kept = tree.best()
    n_fed = len(seq) - run.target_cache.get_seq_length() + len(kept)  # trunk and tree
    with timer(stats, "time_target", run.target.device):
        logits = verify(run.target, run.target_cache, seq, tree, kept)  # (1 + len(kept), vocab)
        path, bonus = accept(tree, kept, logits, run.opts, run.rng)

    # Both caches now hold all of `seq`, then tree nodes: the target's the kept ones, the
    # draft's the fed ones. Keep `seq` plus the accepted path; the bonus is the next root,
    # seen by neither. The path's last node may be a leaf the draft never fed: it is then
    # part of the draft's trunk at the next step.
    keep_path(run.target_cache, kept, path)
    keep_path(run.draft_cache, tree.fed, path)
    # The invariant: the target's cache holds the new `seq` but its last token (the bonus),
    # the draft's that too, or all but the path's last node if it never fed it (or less,
    # after a step without a tree).
    n_seen = len(seq) + len(path)
    lengths = run.draft_cache.get_seq_length(), run.target_cache.get_seq_length()
    assert n_seen - 1 <= lengths[0] or not budget, f"draft cache {lengths[0]}, {n_seen}"
    assert lengths[0] <= lengths[1] == n_seen, f"cache lengths {lengths}, {n_seen}"

    stats.tree_sizes.append(len(kept))
    stats.choices.append((budget, depth))
    if run.cost:
        run.cost.observe((budget, depth), n_fed, started, stats, tree, path, bonus)
    return [tree.tokens[node] for node in path] + [bonus]


# ---- generation loop ----


def decode_loop(step, seq, run, eos, on_tokens):
    """The loop shared by SpecExec and the baseline: step until a stop condition holds."""
    stats, new_tokens = run.stats, []
    start = time.perf_counter()
    while len(new_tokens) < run.opts.max_new_tokens and len(seq) < run.limit:
        tokens = step(run, seq)
        # Cut at the token limit, the context, and just after the first EOS.
        tokens = tokens[: min(run.opts.max_new_tokens - len(new_tokens), run.limit - len(seq))]
        ends = [i for i, t in enumerate(tokens) if t in eos]
        tokens = tokens[: ends[0] + 1] if ends else tokens
        stats.steps += 1
        stats.emitted.append(len(tokens))
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
    opts = Options(**options)
    check_draft_vocab(target.config, draft.config)
    limit = min(context_length(target.config), context_length(draft.config))
    seq = prompt_tokens(input_ids, limit, target=target, draft=draft)
    run = Run(target, draft, opts, limit)
    eos = stop_tokens(eos_token_id, target)
    return decode_loop(speculative_step, seq, run, eos, on_tokens)


# ---- autoregressive baseline ----


@torch.no_grad()
def autoregressive(model, input_ids, *, eos_token_id=None, on_tokens=None, **options):
    """Plain decoding, one target pass per token, with the same sampling, stopping and Stats.

    The reference SpecExec is held against: at temperature 0 and with the same seed at
    any temperature, `generate` returns exactly these tokens.
    """
    opts = Options(**options)
    limit = context_length(model.config)
    seq = prompt_tokens(input_ids, limit, model=model)
    return decode_loop(
        plain_step, seq, Run(model, None, opts, limit), stop_tokens(eos_token_id, model), on_tokens
    )


def plain_step(run, seq):
    """One target pass over what its cache lacks; the target's next token."""
    with timer(run.stats, "time_target", run.target.device):
        trunk = seq[run.target_cache.get_seq_length() :]
        logits = tree_forward(
            run.target, run.target_cache, trunk, chain(len(trunk))
        )  # (len(trunk), vocab)
        check_finite(logits[-1], "target")
        return [choose(logits[-1], run.opts, run.rng)]
