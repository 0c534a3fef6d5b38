"""SpecExec: massively parallel speculative decoding, in one readable file.

Svirschevski et al., "SpecExec: Massively Parallel Speculative Decoding for Interactive LLM
Inference on Consumer Devices", arXiv 2406.02532.

The idea. When a big *target* model's weights stream from RAM or SSD for every forward pass,
a pass over a thousand tokens costs about as much as a pass over one. So a small *draft* model
grows a large tree of likely continuations, best-first by cumulative draft probability, and
keeps the `budget` most probable nodes. The target scores the whole tree in ONE pass, each node
seeing only its ancestors (a tree attention mask). From the root we follow the target's own pick
while it is a child in the tree, and end with its pick at the last node reached (the bonus).
Every token is the target's own pick, so the output is exactly what the target alone would
write: its greedy decoding, or an exact sample. Any candidate can join the tree: here also what
followed the last tokens earlier in the text (prompt `lookup`), at no draft pass.

Words of the paper -> names in the code:

    target model (large, slow)            target
    draft model (small, fast)             draft
    token budget / tree size              budget        (draft nodes verified per step)
    max tree depth / draft iterations     max_depth     (draft passes per step; a node's
                                                        distance from the root: its depth)
    beam width (nodes expanded per pass)  width
    children kept per expanded node       branch
    cumulative (path) probability         cum_logprob   (log of the draft's path probability)
    last accepted, not yet seen token     root          (the tree's root)
    the target's next token at a node     pick          (argmax, or one exact sample)
    bonus token                           bonus
    one target forward pass               a step        (Stats.steps)

`seq` is the prompt plus every accepted token. The invariant that makes the caches simple:
after each step, the target's KV cache holds `seq` without its last token (the root of the next
tree), the draft's a prefix of that; a model is first fed the part of `seq` its cache lacks (the
"trunk"); the entries before a tree are its prefix (`n_prefix`). `speculative_step` asserts it.
"""

import heapq
import math
import sys
import time
from array import array
from dataclasses import dataclass, field

from specexec_tools import SpecExecError, check_call, check_finite, check_options

# ---- options ----


@dataclass
class Options:
    """Generation options: one source of defaults for the API and the CLI, each field's comment
    its help (`python specexec.py --help` shows them)."""

    max_new_tokens: int = 128  # stop after this many new tokens
    budget: int | str = "auto"  # draft nodes verified per step; "auto": the size and max_depth
    # with the most tokens/s, chosen as it runs (specexec_tools/cost_model.py)
    max_depth: int = 16  # draft passes per step (auto: at most this; streamed target: twice)
    width: int = 32  # nodes expanded per draft pass
    branch: int = 8  # children kept per expanded node
    lookup: int = 32  # prompt lookup: the longest continuation copied into the tree (0: none)
    temperature: float = 0.0  # 0: greedy (exact argmax)
    top_p: float = 1.0  # nucleus sampling mass (1: off)
    top_k: int = 0  # sample from the k most likely (0: off)
    seed: int | None = None  # sampling's random seed (None: a fresh one)
    threads: int | None = None  # CPU threads of target passes (None: one per free core, unless
    # OMP_NUM_THREADS says; 0: torch's setting)
    draft_threads: int | None = None  # CPU threads of draft passes (None: 1 for a small draft,
    # torch's setting from 50M parameters; 0: torch's setting); output is unchanged
    draft_temperature: float | None = None  # how the draft ranks the tree (None: 0.3 when greedy,
    # else the sampling temperature); output is unchanged

    def __post_init__(self):
        check_options(self)


if __name__ == "__main__":  # `python specexec.py`: its flags are read and checked before torch
    sys.modules["specexec"] = sys.modules["__main__"]  # loads (seconds); this file is read once
    from specexec_app import cli

    args = cli.read_flags()  # and run at the end of this file

import torch  # noqa: E402  (after the options: --help and a bad flag need no torch)
from torch.nn.attention import sdpa_kernel  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from specexec_tools import models  # noqa: E402
from specexec_tools.cost_model import FixedBudget, make_policy  # noqa: E402
from specexec_tools.models import ATTENTION_KERNELS, CACHE, Clock, attention_windows, preflight  # noqa

# ---- draft tree (priority queue) ----


@dataclass
class DraftTree:
    """Every node found; node 0 is the root, the last token of `seq`. Two heaps, each entry ending
    in its node: `candidates` (found, not yet expanded) give up their best first, `best_nodes`
    (the `budget` best so far) their worst."""

    tokens: list  # token of each node
    parents: list  # parent node of each node; -1 for the root
    cum_logprob: list  # draft log-probability of the path from the root (root: 0)
    depth: list  # edges from the root (root: 0)
    budget: int  # how many nodes (besides the root) the target will verify
    candidates: list = field(default_factory=list)  # heap of rank(node)s: best on top
    best_nodes: list = field(default_factory=list)  # heap of (rank reversed, node): worst on top
    expanded: list = field(default_factory=list)  # nodes (not the root) the draft ran, in order
    children: dict = field(default_factory=dict)  # (parent, token) -> node
    looked_up: set = field(default_factory=set)  # nodes that prompt lookup added
    draft_passes: int = 0  # passes that grew it (the first feeds the trunk too)

    def rank(self, node):  # best first: higher cum_logprob; on a tie the earlier node (a parent)
        return (-self.cum_logprob[node], node)

    def add_child(self, parent, token, logprob):  # a new node, `logprob` below its parent
        self.children[(parent, token)] = child = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.cum_logprob.append(self.cum_logprob[parent] + logprob)
        self.depth.append(self.depth[parent] + 1)
        return child

    def add_children(self, nodes, logits, branch, temperature):
        """One draft pass: each node's `branch` most probable children (logits: (len(nodes),
        vocab), the draft's at each node), as candidates and among the best nodes."""
        check_finite(logits, "draft")
        logprobs = torch.log_softmax(logits.float() / temperature, -1)  # (len(nodes), vocab)
        self.draft_passes += 1
        top = torch.topk(logprobs, min(branch, logprobs.shape[-1]))  # (len(nodes), branch) each
        for node, values, tokens in zip(nodes, top.values.tolist(), top.indices.tolist()):
            children = [self.add_child(node, token, value) for value, token in zip(values, tokens)]
            for child in children:  # best first: once one ranks below the best nodes, all do
                if self.admit(child) == child:  # nor will their children enter: not candidates
                    break
                heapq.heappush(self.candidates, self.rank(child))

    def may_enter(self, node):
        """Whether `node` may be a best node: any while there are fewer than `budget`, then one
        ranked above the worst (they only get better: one that cannot enter never will)."""
        full = len(self.best_nodes) == self.budget
        return not full or self.rank(node) < self.rank(self.best_nodes[0][-1])

    def admit(self, node):
        """Put `node` among the best nodes, pushing out the worst once there are `budget`;
        returns the node pushed out (`node` itself if it ranks below them all), or None."""
        entry = (self.cum_logprob[node], -node, node)  # the rank reversed: worst on top
        if len(self.best_nodes) < self.budget:
            heapq.heappush(self.best_nodes, entry)
            return None
        return heapq.heappushpop(self.best_nodes, entry)[-1]

    def pop_candidates(self, width):
        """Up to `width` candidates, best first, that may still give a best node."""
        batch = []
        while self.candidates and len(batch) < width and self.may_enter(self.candidates[0][-1]):
            batch.append(heapq.heappop(self.candidates)[-1])
        return batch

    def add_lookup(self, chains, logprob, room, start=0):
        """Lookup's chains as branches from `start` (the root), each token `logprob` below its
        parent (how often lookup's proposals were taken), no node deeper than `room` (what the
        context has left); a token the draft found there keeps its node, ranked the higher. They
        compete for the budget as the draft's nodes do. Returns the nodes the chains proposed,
        the draft's among them."""
        best = {node for *_, node in self.best_nodes}
        proposed = set()
        for chain in chains:
            node = start
            for token in chain[: room - self.depth[start]]:
                child = self.children.get((node, token))
                if child not in best:  # else the draft's node, or an earlier chain's
                    if child is None:
                        child = self.add_child(node, token, logprob)
                        self.looked_up.add(child)
                    cum = self.cum_logprob[node] + logprob  # below its parent's, as a draft child's
                    self.cum_logprob[child] = max(self.cum_logprob[child], cum)
                    if (out := self.admit(child)) == child:  # out of the budget: the rest too
                        break
                    best = best - {out} | {child}
                proposed.add(child)
                node = child
        return proposed

    def path(self, node):  # the tokens from the root's child down to `node`
        return self.path(self.parents[node]) + [self.tokens[node]] if node else []

    def best(self):
        """The `budget` most probable nodes but the root, parents first: what the target verifies.

        They always form a tree (closed under ancestors): a child's path is its parent's times
        one more probability <= 1, so it never ranks above its parent (ties: the earlier node)."""
        return sorted(node for *_, node in self.best_nodes)

    def local_parents(self, nodes):
        """Each node's parent as an index into `nodes` (parents first), -1 for the root."""
        index = {0: -1} | {node: i for i, node in enumerate(nodes)}
        return [index[self.parents[node]] for node in nodes]


def grow_tree(run, seq, budget, max_depth, width, branch):
    """Best-first search for the `budget` most probable continuations of `seq`: each draft pass
    expands the `width` best candidates in one tree-masked batch after the cache, adding each
    one's `branch` best children; at most `max_depth` passes."""
    tree = DraftTree(tokens=[seq[-1]], parents=[-1], cum_logprob=[0.0], depth=[0], budget=budget)
    if run.draft is None or not budget:  # lookup alone, or plain decoding
        return tree
    cache = run.draft_cache
    windows = run.draft_windows
    # Pass 1: feed the trunk (what the draft's cache lacks, ending with the root).
    trunk = seq[cache.get_seq_length() :]
    if max(trunk) >= run.draft.config.vocab_size:  # the prompt was checked, the target's picks not
        raise SpecExecError(f"the target chose token id {max(trunk)}, which the draft lacks")
    logits = tree_forward(run.draft, cache, windows, trunk, chain(len(trunk)), n_logits=1)
    # The draft ranks the tree as the target samples, or sharpened where it is greedy: the
    # target follows the draft's top choice more often than its probability says.
    temperature = run.opts.draft_temperature or run.opts.temperature or 0.3
    tree.add_children([0], logits, branch, temperature)

    # Tree nodes at depth d sit at position len(seq) - 1 + d, which must fit the context.
    for _ in range(min(max_depth, run.limit - len(seq)) - 1):
        batch = tree.pop_candidates(width)
        if not batch:
            break
        parents = tree.local_parents(tree.expanded + batch)  # the expanded are in the cache
        logits = tree_forward(run.draft, cache, windows, [tree.tokens[n] for n in batch], parents)
        tree.expanded += batch
        tree.add_children(batch, logits, branch, temperature)
    return tree


def lookup_chains(seq, longest, most=4):
    """Prompt lookup, as text repeats itself (code, a rewrite, a list): what followed the longest
    of the last 3, 2 or 1 tokens of `seq` found before, at its `most` latest occurrences, up to
    `longest` tokens; after a new token (a fix), what followed those before it, a token on."""
    for end, skip in ((len(seq), 0), (len(seq) - 1, 1)):  # the last token as found, as replaced
        for n in (3, 2, 1):
            suffix = seq[end - n : end]  # each earlier start of it, the latest first:
            starts = [i for i in range(end - n - 1, -1, -1) if seq[i : i + n] == suffix]
            if starts:
                return [seq[i + n + skip : i + n + skip + longest] for i in starts[:most]]
    return []


@dataclass
class Lookup:
    """Prompt lookup, a source of candidates beside the draft: its chains join the tree under the
    same budget, each edge ranked at the log of how often the target took what it offered."""

    longest: int  # the longest chain copied into the tree (Options.lookup; 0: no lookup)
    taken: int = 1  # proposals the target took, of those offered (a half to start)
    offered: int = 2  # proposals the target could take: their parent on its path

    def add_candidates(self, tree, seq, room):
        """What followed the text's last tokens earlier, from the root; then from the deepest best
        node, its path read as text after `seq`: lookup goes on where the likeliest guess stops.
        No node deeper than `room`. Returns the best nodes lookup proposed, the draft's too."""
        if not tree.budget or not self.longest:  # plain decoding, or no lookup
            return set()
        logprob = math.log(self.taken / self.offered)
        proposed = tree.add_lookup(lookup_chains(seq, self.longest), logprob, room)
        tip = max(tree.best(), key=lambda node: (tree.depth[node], -node), default=0)
        chains = lookup_chains(seq + tree.path(tip), self.longest)
        proposed |= tree.add_lookup(chains, logprob, room, tip)
        return proposed & set(tree.best())

    def count_taken(self, tree, proposed, path):
        """Of its proposals, those the target could take (their parent on the path) and took."""
        offered = {node for node in proposed if tree.parents[node] in {0, *path}}
        self.taken += len(offered & set(path))
        self.offered += len(offered)


# ---- tree attention mask ----


def tree_mask(parents, n_prefix, dtype, device, window=None, n_new=None):
    """Additive attention mask and position ids for `len(parents)` tree tokens after `n_prefix`.

    parents[i] < i is token i's parent among the tree tokens, or -1: the last prefix token.
    Token i sees the prefix, its ancestors and itself (a chain [-1, 0, 1, ...]: a causal mask),
    with a sliding `window` no further back than `window - 1` positions; only the last `n_new`
    rows are made (a draft pass feeds a few nodes below those in its cache). Returns the mask
    (1, 1, n_new, n_prefix + n), additive floats (0 / finfo.min: Hugging Face passes a 4D mask
    as it is, and eager attention would misread booleans), and position ids (1, n_new)."""
    n = len(parents)
    first = n - (n if n_new is None else n_new)  # the first token whose row is asked for
    reach = n_prefix + n if window is None else window  # a row sees back to `reach - 1` positions
    # Each row asked for climbs from its token to the root: it sees what it passes within reach
    rows = []  # with `seen`, pairs (row, j): j is the row's token or one of its ancestors
    seen = []
    depths = []  # each row's depth below the prefix
    for row, i in enumerate(range(first, n)):
        climb = []  # the row's token, then its ancestors up to the root
        while i >= 0:
            climb.append(i)
            i = parents[i]
        rows += [row] * min(len(climb), reach)
        seen += climb[:reach]
        depths.append(len(climb))
    positions = n_prefix - 1 + longs(depths)  # (n_new,)
    near = torch.arange(n_prefix) > positions[:, None] - reach  # (n_new, n_prefix)
    mask = torch.full((n - first, n_prefix + n), torch.finfo(dtype).min, dtype=dtype)  # all hidden
    mask[:, :n_prefix].masked_fill_(near, 0.0)  # (n_new, n_prefix): the prefix within reach
    mask[longs(rows), n_prefix + longs(seen)] = 0.0  # each row's token and its near ancestors
    return mask[None, None].to(device), positions[None].to(device)


def tree_mask_reference(parents, n_prefix, dtype, device, window=None):
    """`tree_mask` built plainly, to hold the fast one against (tests): each token climbs to the
    root unmasking what it passes, then the prefix (with a `window`, fewer positions back)."""
    positions = []  # each token's position: one below its parent's (parents come first)
    for parent in parents:
        positions.append(n_prefix if parent < 0 else positions[parent] + 1)
    key_positions = list(range(n_prefix)) + positions  # (n_prefix + n,)
    mask = torch.full((len(parents), n_prefix + len(parents)), torch.finfo(dtype).min, dtype=dtype)
    for i in range(len(parents)):
        visible = list(range(n_prefix))
        node = i
        while node >= 0:
            visible.append(n_prefix + node)
            node = parents[node]
        for j in visible:
            if window is None or positions[i] - key_positions[j] < window:
                mask[i, j] = 0.0
    return mask[None, None].to(device), torch.tensor([positions], device=device)


def longs(values):  # a list of ints as a LongTensor (len(values),): from an array, 4x faster
    return torch.asarray(array("q", values), dtype=torch.long) if values else torch.zeros(0).long()


def chain(n):
    """Parents of n tokens in a row (a causal mask)."""
    return list(range(-1, n - 1))


def tree_forward(model, cache, windows, tokens, parents, n_logits=0):
    """Run new `tokens` after the cache, as the last nodes of the tree `parents`; the logits of
    the last `n_logits` (0: all; a prompt's rows would cost as much as a few layers).

    One call serves the prompt (a chain), each draft pass and the verification; `parents` may
    start with nodes fed earlier (the cache's last entries). `windows`: how far back each layer
    type looks; the cache keeps every entry, so runs past a window are exact."""
    n_prefix = cache.get_seq_length() - (len(parents) - len(tokens))  # entries before the tree
    rows = dict(dtype=model.dtype, device=model.device, n_new=len(tokens))
    masks = {}  # layer type -> (1, 1, n, n_prefix + len(parents)) mask; None: every layer
    for kind, window in windows.items():
        masks[kind], positions = tree_mask(parents, n_prefix, window=window, **rows)
    out = model(
        input_ids=torch.tensor([tokens], dtype=torch.long, device=model.device),  # (1, n)
        attention_mask=masks.get(None, masks),  # one for all layers, or a dict by layer type
        position_ids=positions,  # (1, n)
        **{CACHE: cache},  # past_key_values= before transformers 5.24
        use_cache=True,
        logits_to_keep=n_logits,
    )
    return out.logits[0]  # (n_logits or n, vocab)


# ---- verification and acceptance ----


def verify(run, seq, tree, nodes):
    """ONE target pass over the trunk and the tree's `nodes`; logits at the root and each node."""
    trunk = seq[run.target_cache.get_seq_length() :]  # usually the root; the prompt at first
    # After the trunk, local parent -1 (the root) lands on the trunk's last token.
    parents = chain(len(trunk)) + [len(trunk) + i for i in tree.local_parents(nodes)]
    tokens = trunk + [tree.tokens[node] for node in nodes]
    n_logits = 1 + len(nodes)  # the root's row, then each node's
    return tree_forward(run.target, run.target_cache, run.target_windows, tokens, parents, n_logits)


def accept(tree, nodes, logits, opts, rng):
    """Follow the target's own picks down the tree; return the accepted nodes and the bonus.

    At each node the target picks the next token from its own distribution: a child among the
    verified `nodes` is taken for free; any other pick is the bonus. Every emitted token is the
    target's pick given all before it: its greedy decoding or an exact sample, wherever the
    nodes came from."""
    row = {node: i for i, node in enumerate([0] + nodes)}  # each node's row of `logits`
    child = {(tree.parents[node], tree.tokens[node]): node for node in nodes}
    path = []
    node = 0
    while True:
        token = pick(logits[row[node]], opts, rng)  # one uniform draw per visited node
        if (node, token) not in child:
            check_finite(logits[[row[visited] for visited in [0, *path]]], "target")
            return path, token
        node = child[(node, token)]
        path.append(node)


def pick(logits, opts, rng):
    """The target's pick: argmax at temperature 0, else one sample (one uniform draw)."""
    if opts.temperature == 0:
        return int(logits.argmax())
    probs = sampling_probs(logits, opts.temperature, opts.top_k, opts.top_p).cpu()  # (vocab,)
    cdf = probs.cumsum(0)  # (vocab,)
    u = torch.rand((), generator=rng, dtype=torch.float64) * cdf[-1]
    # The first token whose cdf exceeds u; zero-probability tokens can never be picked.
    return int(torch.searchsorted(cdf, u, right=True))


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
        probs = probs.index_fill(0, order[mass_above >= top_p], 0.0)
    return probs / probs.sum()


def keep_path(cache, nodes, path):
    """Drop the tree from the cache but for `path` (the cache ends with an entry per node of
    `nodes`). `DynamicCache.crop` only drops a suffix, so the path's entries move up first; the
    prefix is never copied: a step must not cost more as the text grows."""
    n_prefix = cache.get_seq_length() - len(nodes)
    position = {node: n_prefix + i for i, node in enumerate(nodes)}
    on_path = [position[node] for node in path if node in position]  # in order, each >= its slot
    n_keep = n_prefix + len(on_path)
    moved = on_path != list(range(n_prefix, n_keep))  # a path at the front is in place already
    for layer in cache.layers:
        for name in ("keys", "values"):  # each (1, heads, n_prefix + len(nodes), head_dim)
            tensor = getattr(layer, name)
            if moved:  # gathered first, then written: sources never lie before their slots
                index = torch.tensor(on_path, dtype=torch.long, device=tensor.device)  # (n_path,)
                tensor[..., n_prefix:n_keep, :] = tensor.index_select(-2, index)
            setattr(layer, name, tensor[..., :n_keep, :])  # (1, heads, n_keep, head_dim)


# ---- the step ----


@dataclass
class Step:
    """What one step did, for the policy and Stats."""

    tokens: list  # the tokens it emitted: the accepted path's, then the bonus
    budget: int  # the budget it was given; 0: a plain step, no tree
    max_depth: int  # the depth limit it was given
    n_fed: int  # tokens its target pass read: the trunk and the tree
    tree: DraftTree  # the draft's and lookup's nodes (only the root: a plain step)
    path: list  # the accepted tree nodes
    draft_s: float = 0.0  # seconds growing the tree
    target_s: float = 0.0  # seconds of the target pass and acceptance
    total_s: float = 0.0  # seconds of the whole step


def speculative_step(run, seq, budget, max_depth):
    """One SpecExec step: the draft's tree and lookup's branches, ONE target pass, acceptance,
    both caches cut to the path; a `Step` whose tokens are the path's and the bonus. Budget 0 is
    plain decoding: the root's pick alone (the draft's cache waits; its next trunk catches up)."""
    with run.clock.draft(budget):
        tree = grow_tree(run, seq, budget, max_depth, run.opts.width, run.opts.branch)
        proposed = run.lookup.add_candidates(tree, seq, room=run.limit - len(seq))
        nodes = tree.best()  # the `budget` most probable: what the target verifies
    n_fed = len(seq) - run.target_cache.get_seq_length() + len(nodes)  # trunk and tree
    with run.clock.target():
        logits = verify(run, seq, tree, nodes)  # (1 + len(nodes), vocab)
        path, bonus = accept(tree, nodes, logits, run.opts, run.rng)
    run.lookup.count_taken(tree, proposed, path)

    # Both caches hold `seq`, then the verified (target) or expanded (draft) nodes: keep `seq` and
    # the path; the bonus is in neither, and path nodes the draft never ran join its next trunk.
    keep_path(run.target_cache, nodes, path)
    assert run.target_cache.get_seq_length() == len(seq) + len(path)  # the new seq but its last
    if run.draft is not None and budget:  # the draft's: `seq`, then the path's expanded nodes
        keep_path(run.draft_cache, tree.expanded, path)
        assert run.draft_cache.get_seq_length() == len(seq) + len(set(path) & set(tree.expanded))
    tokens = [tree.tokens[node] for node in path] + [bonus]
    return Step(tokens, budget, max_depth, n_fed, tree, path, **run.clock.step_seconds())


# ---- the loop ----


@dataclass
class Run:
    """One generation's state: models, caches, options, the picks' random numbers, what is found
    once (attention windows), prompt lookup's record, the steps' clock."""

    target: object  # any causal LM with Hugging Face's call signature (offload.py's too)
    draft: object | None  # None: plain decoding, or lookup's trees alone
    opts: Options
    limit: int  # positions both models can use (the shorter context)

    def __post_init__(self):
        models.use_threads(self.opts.threads)  # the target's: one per free core, or as chosen
        self.seed = self.opts.seed if self.opts.seed is not None else torch.seed()
        self.rng = torch.Generator().manual_seed(self.seed)
        self.target_cache = DynamicCache()
        self.target_windows = attention_windows(self.target)
        self.draft_cache = DynamicCache()  # empty without a draft
        self.draft_windows = None if self.draft is None else attention_windows(self.draft)
        self.lookup = Lookup(self.opts.lookup)
        self.clock = Clock(self.target, self.draft, self.opts)  # where a step's seconds go


@torch.no_grad()
@sdpa_kernel(ATTENTION_KERNELS)  # a GPU's attention without cuDNN's (specexec_tools/models.py)
def decode_loop(run, seq, policy, eos, on_tokens=None):
    """The loop of SpecExec and the baseline: ask the policy (a fixed budget, or auto's cost
    model) for a budget, step, tell it what the step did, until max_new_tokens, the context or
    an EOS. The caller checked the inputs (`generate` does)."""
    stats = Stats(policy=policy, seed=run.seed if run.opts.temperature > 0 else None)
    n_prompt = len(seq)
    end = min(n_prompt + run.opts.max_new_tokens, run.limit)
    start = time.perf_counter()
    while len(seq) < end:
        trunk = len(seq) - run.target_cache.get_seq_length()  # what the target's pass reads first
        budget, max_depth = policy.choose(end - len(seq), trunk)  # and tokens still to come
        step = speculative_step(run, seq, budget, max_depth)
        policy.update(step)
        # Cut at the token limit or the context's end, and just after the first EOS.
        eos_ends = [i + 1 for i, token in enumerate(step.tokens) if token in eos]
        tokens = step.tokens[: min([end - len(seq), *eos_ends])]
        stats.add(step, len(tokens))
        seq += tokens
        if on_tokens is not None:
            on_tokens(tokens)
        if tokens[-1] in eos:
            break
    stats.time_total = time.perf_counter() - start
    stats.context_full = len(seq) >= run.limit and not (len(seq) > n_prompt and seq[-1] in eos)
    return seq[n_prompt:], stats


def generate(target, draft, input_ids, *, eos_token_id=None, on_tokens=None, opts=None, **options):
    """SpecExec decoding: (new_tokens, Stats), the tokens the target alone would emit.

    input_ids: ints or a LongTensor (1, n). draft: a model, or None (with `lookup`: its trees
    alone). opts: an `Options`, or its fields as keywords. eos_token_id: an int or a list (the
    target's generation config's by default; [] = none). on_tokens(list): each step's tokens."""
    opts = check_call(opts, options, on_tokens, Options)
    seq, limit, eos = preflight(target, draft, input_ids, eos_token_id)
    run = Run(target, draft, opts, limit)
    return decode_loop(run, seq, make_policy(opts, target, draft), eos, on_tokens)


def autoregressive(model, input_ids, *, eos_token_id=None, on_tokens=None, opts=None, **options):
    """Plain decoding, one target pass per token, with the same sampling, stopping and Stats:
    the reference SpecExec is held against (greedy, or with the same seed, the same tokens)."""
    opts = check_call(opts, options, on_tokens, Options)
    seq, limit, eos = preflight(model, None, input_ids, eos_token_id)
    return decode_loop(Run(model, None, opts, limit), seq, FixedBudget(0, 0), eos, on_tokens)


# ---- what a run did ----


@dataclass
class Stats:
    """What a run did, step by step (a step: one target pass), as specexec_app/cli.py words it."""

    emitted: list = field(default_factory=list)  # tokens kept per step: accepted path + bonus
    budgets: list = field(default_factory=list)  # (budget, max_depth) each step was given
    tree_depths: list = field(default_factory=list)  # how deep each step's verified tree went
    draft_passes: int = 0
    policy: object = None  # what sized the steps: FixedBudget, or auto's CostModel
    seed: int | None = None  # sampling's: the run is reproduced with it
    context_full: bool = False  # it stopped because the context was full
    time_draft: float = 0.0
    time_target: float = 0.0
    time_total: float = 0.0

    def add(self, step, n_emitted):
        """One step, of which `n_emitted` tokens were kept (the rest lay past a stop)."""
        self.emitted.append(n_emitted)
        self.budgets.append((step.budget, step.max_depth))
        self.tree_depths.append(max((step.tree.depth[n] for n in step.tree.best()), default=0))
        self.draft_passes += step.tree.draft_passes
        self.time_draft += step.draft_s
        self.time_target += step.target_s

    @property
    def steps(self):
        return len(self.emitted)

    @property
    def new_tokens(self):
        return sum(self.emitted)

    @property
    def tokens_per_step(self):
        return self.new_tokens / max(1, self.steps)

    @property
    def tokens_per_second(self):
        return self.new_tokens / max(1e-9, self.time_total)


if __name__ == "__main__":  # `python specexec.py`, its flags read above
    cli.main(args)
