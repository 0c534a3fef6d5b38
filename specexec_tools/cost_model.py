"""The budget policies: a fixed budget, and budget "auto": before each SpecExec step, the tree
size and depth limit with the most tokens/s. `make_policy` gives a run the one its options name.

A step over the b best nodes no deeper than d (budget b, max_depth d) yields E[tokens](b, d) and
costs d draft passes, one target pass over the tree and some bookkeeping; auto takes the b and d
maximising

    tokens/s = E[tokens](b, d) / (t_target(b + 1) + max(0, d * t_draft + t_other - t_ahead)),

each term measured as the run goes. t_ahead is 0 but where the target streams its weights: there
the link loads the next pass's first layers while the draft works (offload.py's ring), and the
draft's work within that time adds nothing to the step. The loop (specexec.decode_loop) asks
`choose` before each step and hands `update` what the step did (a specexec.Step). It knows nothing
of models: a tree is anything with `tokens`, `parents`, `cum_logprob`, `depth` and `looked_up`
(specexec.DraftTree); only `make_policy` reads the models' configs."""

import math
import weakref
from dataclasses import astuple, dataclass, field, replace
from itertools import accumulate, islice


@dataclass
class FixedBudget:
    """Every step the same (budget, max_depth); budget 0 is plain decoding. Auto (CostModel) has
    the same two methods: `choose` before each step, `update` with what it did (a specexec.Step)."""

    budget: int
    max_depth: int
    why: str = ""  # for the summary: why a run with a draft decodes plainly

    def choose(self, left=None, trunk=1):  # as auto's (which heeds them)
        return self.budget, self.max_depth

    def update(self, step):
        pass


# What auto learned of a pair with a streamed target (offload.py), kept from one `generate` to the
# next in one process, as a conversation keeps it: target -> {(draft's id, options): (the draft,
# its cost model)}; the draft kept to tell it from another draft given the same id later
LEARNED = weakref.WeakKeyDictionary()


def make_policy(opts, target, draft):
    """The policy `opts.budget` names: a fixed budget, or "auto"; with no draft nor lookup, plain
    decoding. Auto's cost model is the one the pair had last, with the same options, if any.

    Auto decodes plainly from the first step where no tree can pay, which it would otherwise
    learn only from a first tree: the draft is an int8 / int4 model at least the target's size
    (the target's own copy: offload.self_draft) and the target's weights stay put, so d draft
    passes cost about d target passes, for at most d + 1 tokens. Beside a streamed target that
    copy pays."""
    if draft is None and not opts.lookup:
        return FixedBudget(0, 0)
    if opts.budget != "auto":
        return FixedBudget(opts.budget, opts.max_depth)
    quantized = getattr(draft, "quantized", None)
    streamed = streams(target)
    if quantized and weights(draft) >= weights(target) and not streamed:
        why = f"its {quantized} draft is the target's size and costs what the target does"
        return FixedBudget(0, 0, why=f"auto decoded plainly: {why} (no tree can pay)")
    learned = {}  # kept only where the target streams: there each step of learning is dear
    if streamed and hasattr(target, "stats"):
        learned = LEARNED.setdefault(target, {})
    key = (id(draft), astuple(replace(opts, max_new_tokens=0, seed=None)))
    if key in learned and learned[key][0] is draft:
        return learned[key][1]
    # The first tree, chosen before anything is measured: where the target streams its weights,
    # as big as a pass carries for about the cost of one token's; where they stay put, a small
    # one, since there a tree's pass costs compute, and the draft must read the prompt too
    first = dict(budget=32, first_depth=4) if streamed else dict(budget=8, first_depth=2)
    share = 0.0 if streamed or draft is None else weights(draft) / weights(target)
    # Where the target streams, a pass is dear: trees twice as deep. Two of its passes timed
    # (offload.py's `time_passes`, once per model: tokens -> seconds, and those not waiting for
    # weights) are auto's first measurements: its first tree is sized for them.
    max_depth = 2 * opts.max_depth if streamed else opts.max_depth
    if streamed and hasattr(target, "time_passes") and not target.pass_costs:
        target.time_passes()
    costs = getattr(target, "pass_costs", {}) if streamed else {}
    policy = CostModel(
        max_depth=max_depth,
        draft_share=share,
        **first,
        target_s={n: seconds for n, (seconds, _) in costs.items()},
        busy_s={n: busy for n, (_, busy) in costs.items()},
        target=target if streamed and hasattr(target, "stats") else None,  # offload.py's
    )
    learned[key] = (draft, policy)
    return policy


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


# ---- budget auto ----


def running_mean(old, new, weight=0.3):
    """An exponential running mean: recent steps count most (costs drift as the context grows).
    The newest step weighs `weight`; the older ones fade by 1 - weight a step."""
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class CostModel:
    """Budget auto: before each step, the (budget, max_depth) with the most tokens/s predicted
    from what the run measured: each size of target pass and the draft pass (the cost), how often
    the target picked a draft's child of each draft probability (the gain), and how far trees fell
    short of their promise. Plain decoding (budget 0) where no tree pays, with a look at the
    draft now and then. Each rule's details sit beside the code that applies it."""

    max_depth: int  # the depth limit of auto's trees (the run's; twice it where the target streams)
    budget: int = 32  # the first step's, before anything is measured (make_policy's)
    first_depth: int = 4  # the first tree's: few passes of a draft not yet timed; deeper as it pays
    draft_share: float = 0.0  # a draft pass's cost in target passes, before any is timed (weights)
    why: str = ""  # for the summary: why it decoded plainly from the start
    target_s: dict = field(default_factory=dict)  # tokens fed -> seconds of a target pass
    # tokens fed -> seconds of it not spent waiting for weights (a streamed target's: its compute)
    busy_s: dict = field(default_factory=dict)
    # a streamed target (offload.py): its last pass's `stats.wait_s` (waiting for weights),
    # `stats.ahead_s` (its link loading before the pass began) and `stats.link_idle_s` (the link
    # idle then: all it had to load had landed)
    target: object = None
    draft_s: float | None = None  # seconds of one draft pass (the first tree's: the prompt too)
    other_s: float = 0.0  # seconds of the rest of a step
    ahead_s: float = 0.0  # seconds of a step's work outside its target pass that the link hides
    step_s: dict = field(default_factory=dict)  # (budget, max_depth) run -> seconds of its steps
    time_scale: float = 1.0  # whole steps' seconds / their parts' (a running mean)
    # Per bin of an edge's draft log-probability (a child's, given its parent): children of
    # nodes the target reached, and those whose token it picked there
    seen: list = field(default_factory=lambda: [0] * 48)
    followed: list = field(default_factory=lambda: [0] * 48)
    # (budget, max_depth) -> (E[tokens], draft passes): what trees of it would have given
    gains: dict = field(default_factory=dict)
    largest: int = 0  # the largest budget run so far
    steps: int = 0
    tree_steps: int = 0
    plain_s: float = 0.0  # seconds of plain steps in a row
    looks: int = 0  # tree steps chosen only to look again, since a tree step last paid
    # Sums over the run's tree steps of (tokens, seconds): as they came, and as promised
    given: tuple = (0.0, 0.0)
    promised: tuple = (0.0, 0.0)
    promise: tuple | None = None  # this step's (tokens, seconds), if a tree's predicted ones
    curve: tuple = field(default=(), init=False, repr=False)  # t_target's memo, and what it read

    # The tree sizes auto considers, 1 .. 2048, doubling: a tree gives about one token more each
    # time it doubles (first_tree), so sizes between would add candidates, not tokens
    BUDGETS = tuple(2**k for k in range(12))
    # The depth limits it considers: each one while shallow, where a pass more or less matters
    # most, then wider steps; and the policy's own max_depth, though none of these (deepen)
    DEPTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    # Past the sizes measured a pass's cost is a guess: a tree is a candidate up to GROWTH times
    # the largest run, so auto learns the cost of bigger trees a few sizes at a time (rates)
    GROWTH = 4
    # What looking at the draft may cost, at most: 1 / LOOK_EVERY (5%) of the time of the plain
    # steps around a look (look) or still to come (first_look), or of a step searched deeper
    LOOK_EVERY = 20
    # A dear draft still searches one depth deeper every DEEPEN_EVERY tree steps: a deeper tree's
    # gains are seen only by a tree searched that deep (deepen)
    DEEPEN_EVERY = 4
    # Children counted as picked at the draft's own probability in each bin: a few unlucky steps
    # must not rule trees out for good (follow_rate)
    PRIOR = 4
    # Tokens counted as given as promised before any tree step: rate_scale starts at 1, and the
    # first few tree steps move it less than they would alone
    PRIOR_TOKENS = 2
    # A target pass that outlasts this many draft passes moves weights, and bigger trees cost
    # about as much: the first tree stays until its line is drawn (decide's second size)
    STREAMED = 100

    # ---- the cost ----

    def t_target(self, n):
        """Seconds of a target pass over n tokens, measured at each size run (the first pass too:
        it reads the prompt, a pass over many tokens, which bounds what big trees cost): between
        two sizes run, on the line between them (a streamed target's: the longer of the smaller
        size's pass and the compute on the line between theirs); outside, on the line through the
        nearest two (never below the nearest), or past the largest size of a streamed target, the
        longer of that pass and its compute grown in proportion to the tokens (`busy_s`: a link's
        time does not grow, compute does). A pass never costs more than a bigger one: a size
        measured in a busy moment counts as the cheapest bigger size, so that one slow pass
        cannot rule its size out for good.

        The sizes run, ascending, the cheapest pass at each size or above, and the answers so far
        are remembered until a pass is measured: `rates` asks for every candidate at every step,
        and auto's own time is time plain decoding does not spend."""
        measured = (self.target_s, self.busy_s)
        if not self.curve or self.curve[3] != measured:
            sizes = sorted(self.target_s)  # the cheapest: a running minimum from the largest down
            cheapest = [*accumulate((self.target_s[size] for size in reversed(sizes)), min)][::-1]
            self.curve = (sizes, cheapest, {}, (dict(self.target_s), dict(self.busy_s)))
        sizes, cheapest, known, _ = self.curve
        if n in known:
            return known[n]
        largest = sizes[-1]
        if n > largest and largest in self.busy_s:
            # A streamed pass past the largest size: its compute grows with its tokens while the
            # link's time does not; once the compute outlasts the link, the pass costs the
            # compute. Where a pass is the link's (the paper's regime), bigger trees cost the same
            # until their compute would outlast the link: there auto stops growing them
            seconds = max(cheapest[-1], self.busy_s[largest] * n / largest)
        elif len(sizes) == 1:
            seconds = cheapest[0]
        else:
            i = min(max(1, sum(size < n for size in sizes)), len(sizes) - 1)  # the segment
            (n0, t0), (n1, t1) = zip(sizes[i - 1 : i + 1], cheapest[i - 1 : i + 1])
            seconds = t0 + (t1 - t0) / (n1 - n0) * (n - n0)
            seconds = max(seconds, t1) if n > n1 else max(seconds, 0.0)
            if n0 < n < n1 and n0 in self.busy_s and n1 in self.busy_s:
                # A streamed pass between two sizes: the longer of the smaller size's pass (the
                # link's time does not grow) and its compute, on the line between the two sizes'.
                # The line between the passes themselves would charge a tree the compute of the
                # prompt's first pass (thousands of tokens) long before it outlasts the link
                busy = self.busy_s[n0]
                compute = busy + (self.busy_s[n1] - busy) / (n1 - n0) * (n - n0)
                seconds = min(seconds, max(t0, compute))
        known[n] = seconds
        return seconds

    def from_parts(self, budget, passes):
        """A step's seconds from its parts: one target pass over the tree and its root, and what
        of `passes` draft passes (t_draft each: `draft_s`) and the rest of a step (t_other:
        `other_s`) outlasts the link's loads ahead of the pass (t_ahead: `ahead_s`)."""
        outside = (passes * self.draft_s if budget else 0.0) + self.other_s
        return self.t_target(budget + 1) + max(0.0, outside - self.ahead_s)

    def seconds(self, choice, passes):
        """A step's seconds: a (budget, max_depth) already run is charged what its steps took, as
        a whole; one not yet run, its parts, scaled by how far the parts have fallen short of
        whole steps so far (`time_scale`)."""
        if choice in self.step_s:
            return self.step_s[choice]
        return self.time_scale * self.from_parts(choice[0], passes)

    # ---- the gain ----

    def bin(self, logprob):
        """Quarter-nat bins of an edge's draft log-probability (at the tree's temperature)."""
        return min(len(self.seen) - 1, int(-4 * logprob))

    def follow_rate(self, logprob):
        """How often the target, at a node it reached, picked a child of this bin; with `PRIOR`
        children picked at the draft's own probability: a few unlucky steps must not rule
        trees out for good."""
        b = self.bin(logprob)
        return (self.followed[b] + self.PRIOR * math.exp(logprob)) / (self.seen[b] + self.PRIOR)

    def reach(self, tree):
        """The chance that the target walks to each node of the tree (the root: 1): the chance it
        reaches the parent, times the chance that there it picks this node's token, read off how
        often the target picked a child of about this draft probability (given its parent) at a
        node it reached so far (`follow_rate`). Edge by edge, because a deep node of a given path
        probability is reached far less often than a shallow one of the same: the draft's
        confidence compounds along a path, its errors too."""
        cum = tree.cum_logprob  # (n + 1,): the root first
        reach = [1.0] * len(cum)
        for node, up in enumerate(tree.parents[1:], start=1):  # parents come before children
            reach[node] = reach[up] * self.follow_rate(cum[node] - cum[up])
        return reach

    def tree_gains(self, tree, max_depth):
        """E[tokens] and draft passes of each (budget b, max_depth d) that a tree searched to
        `max_depth` can show. The tree of the b best nodes no deeper than d is the first b of
        them, best first, and gives 1 (the bonus token) plus, for each node, the chance that the
        target walks to it (`reach`); a search for it needs as many draft passes as it is deep.
        Plain Python: a tree of 1,024 best nodes has found thousands, and tensors made of them
        cost as long as these walks (the tests hold this against a walk up from every node)."""
        cum = tree.cum_logprob  # the root first
        reach = self.reach(tree)
        # the draft passes that reach each node: its depth; lookup's nodes none, at any depth
        passes = [0 if node in tree.looked_up else depth for node, depth in enumerate(tree.depth)]
        best_first = sorted(range(1, len(cum)), key=cum.__getitem__, reverse=True)  # stable
        gains = {}
        for d in (d for d in self.DEPTHS if d <= max_depth):
            searched = (node for node in best_first if passes[node] <= d)
            nodes = list(islice(searched, self.BUDGETS[-1]))  # no budget takes more
            gain = list(accumulate((reach[node] for node in nodes), initial=1.0))  # 1: the bonus
            needed = list(accumulate((passes[node] for node in nodes), max))
            for b in self.BUDGETS:
                if d <= b <= len(nodes):  # b nodes are never deeper than b: more passes buy nothing
                    gains[(b, d)] = (gain[b], needed[b - 1])
        return gains

    @property
    def rate_scale(self):
        """What the trees gave: the tokens/s of the run's tree steps over what was promised when
        each was chosen (its predicted tokens and seconds): their tokens (with `PRIOR_TOKENS`
        more, given as promised) over those promised, and the seconds promised over those they
        took. Every tree's predicted tokens/s is scaled by it (`rates`). The best of many noisy
        predictions is an optimistic one: in memory, sampling, trees were promised about 25%
        more tokens/s than they gave. A draft that is sure and wrong (a truncated copy of the
        target) would be trusted for many steps too. Held against their promises, a draft whose
        trees give ~1 token is dropped within a few steps, and trees that only beat plain
        decoding on paper stop running."""
        tokens, seconds = self.given
        promised, promised_s = self.promised
        if not promised:
            return 1.0
        return (tokens + self.PRIOR_TOKENS) / (promised + self.PRIOR_TOKENS) * promised_s / seconds

    # ---- measuring ----

    def update(self, step):
        """What a step (specexec.Step) of (budget, max_depth) cost; a tree step's draft pass, what
        it gave against its promise, and what the target picked at each node it reached."""
        choice = (step.budget, step.max_depth)
        target_s = step.target_s
        if self.target is not None:  # a streamed target
            self.learn_link(step)
            target_s += self.target.stats.ahead_s  # the pass as if nothing had loaded ahead of it
        self.target_s[step.n_fed] = running_mean(self.target_s.get(step.n_fed), target_s)
        if self.steps:  # not the first step, which reads the prompt too: no step's whole cost
            if step.budget:  # how far the parts fell short of the whole, as predicted
                passes = self.gains.get(choice, (0, step.tree.draft_passes))[1]
                predicted = self.from_parts(step.budget, passes)
                self.time_scale = running_mean(self.time_scale, step.total_s / predicted)
            self.step_s[choice] = running_mean(self.step_s.get(choice), step.total_s)
            other_s = step.total_s - step.draft_s - step.target_s
            self.other_s = running_mean(self.other_s if self.steps > 1 else None, other_s)
        self.steps += 1
        self.plain_s = 0.0 if step.budget else self.plain_s + step.total_s
        if not step.budget:
            return
        if len(step.tokens) / step.total_s > 1 / self.seconds((0, 0), 0):
            self.looks = 0  # it paid: looks, if needed again, start from the shortest wait
        self.tree_steps += 1
        self.largest = max(self.largest, step.budget)
        # The first tree's draft passes read the prompt too: its draft pass stands only until
        # a second tree's replaces it (as the first step's whole cost does for other_s). Lookup
        # alone: no pass.
        old_draft_s = self.draft_s if self.tree_steps > 2 else None
        self.draft_s = running_mean(old_draft_s, step.draft_s / max(1, step.tree.draft_passes))
        self.hold_to_promise(step)
        self.learn_gains(step)

    def learn_link(self, step):
        """A streamed target's pass: its seconds not waiting for weights (its compute: `busy_s`),
        and how long its link loads ahead of a pass while the draft works (`ahead_s`). The
        pass's `stats.ahead_s` are the seconds it loaded before this pass began: where it then
        idled, all it had to load had landed, and that is how long it loads ahead; where it
        never idled, at least that long."""
        stats = self.target.stats
        busy = step.target_s - stats.wait_s
        self.busy_s[step.n_fed] = running_mean(self.busy_s.get(step.n_fed), busy)
        if stats.link_idle_s > 0:
            self.ahead_s = running_mean(self.ahead_s if self.ahead_s else None, stats.ahead_s)
        else:
            self.ahead_s = max(self.ahead_s, stats.ahead_s)

    def hold_to_promise(self, step):
        """A tree step's tokens and seconds, added to `given`; its promise, to `promised` (see
        rate_scale). A tree chosen before its gains were seen (the first) is held against what
        its draft's probabilities expected, in the time it took."""
        promise = self.promise
        self.promise = None
        if promise is None:
            reach = self.reach(step.tree)
            promise = (1 + sum(reach[node] for node in step.tree.best()), step.total_s)
        tokens, seconds = self.given
        self.given = (tokens + len(step.tokens), seconds + step.total_s)
        promised, promised_s = self.promised
        self.promised = (promised + promise[0], promised_s + promise[1])

    def learn_gains(self, step):
        """What the target picked at each node it reached (the path's tokens, then the bonus),
        counted against every child the draft proposed there (`follow_rate`); then the gains of
        each (budget, max_depth) this tree shows, averaged over recent trees."""
        tree = step.tree
        picked = dict(zip([0, *step.path], step.tokens))  # at each node reached, the target's pick
        for node, parent in enumerate(tree.parents):  # every child the draft proposed there
            if parent in picked:
                edge = self.bin(tree.cum_logprob[node] - tree.cum_logprob[parent])
                self.seen[edge] += 1
                self.followed[edge] += tree.tokens[node] == picked[parent]
        for choice, (gain, passes) in self.tree_gains(tree, step.max_depth).items():
            old_gain, old_passes = self.gains.get(choice, (None, None))
            self.gains[choice] = (running_mean(old_gain, gain), running_mean(old_passes, passes))
        # A deeper search finds at least what this one did: its older, smaller guesses rise
        for (budget, max_depth), (gain, passes) in self.gains.items():
            searched = (budget, step.max_depth)
            if max_depth > step.max_depth and searched in self.gains:
                self.gains[(budget, max_depth)] = (max(gain, self.gains[searched][0]), passes)

    # ---- choosing ----

    def rates(self):
        """Predicted tokens per second of each (budget, max_depth); budget 0 is no tree. A tree
        is a candidate when its pass lies between two sizes measured (the prompt's pass is the
        largest), or is at most GROWTH times the largest tree run so far. With one size measured
        (the first pass), every size would cost the same: auto stays at the trees run until a
        second size draws the line."""
        rates = {(0, 0): 1 / self.seconds((0, 0), 0)}
        sizes = sorted(self.target_s)
        most = max(self.GROWTH * self.largest, sizes[-1] - 1) if sizes[1:] else self.largest
        scale = self.rate_scale
        for (b, d), (gain, passes) in self.gains.items():
            if b <= most:
                rates[(b, d)] = scale * gain / self.seconds((b, d), passes)
        return rates

    def choose(self, left=math.inf, trunk=1):
        """This step's (budget, max_depth), `left` tokens still to come, the target's pass to read
        `trunk` tokens before the tree (the root; at the first step, the prompt); a tree's
        predicted (tokens, seconds) kept as its promise."""
        choice = self.decide(left, trunk)
        self.promise = None
        if choice in self.gains:  # a tree whose gains were seen (plain decoding's never are)
            gain, passes = self.gains[choice]
            self.promise = (gain, self.seconds(choice, passes))
        return choice

    def decide(self, left, trunk):
        """The (budget, max_depth) with the most tokens/s predicted; before any tree, the first;
        where plain decoding is best, now and then a look at the draft; a deeper search while the
        best nodes reach the depth limit."""
        if not self.gains or self.draft_s is None:  # no tree yet
            if self.target_s and not self.steps:  # passes timed at load: the first tree fits them
                return self.first_tree(trunk)
            return self.first_look(left)
        # The second size. After the first step one size is measured: the prompt's pass with the
        # first tree. Where the target streams its weights, a pass costs their transfer, more
        # than STREAMED draft passes, and bigger trees cost about as much: the first tree stays
        # until its line is drawn (rates). Where a draft pass costs more than that share, a
        # pass's cost may grow with its size (compute), and the second step is a plain one: a
        # pass over one token, the second size, at no cost against plain decoding, and what a
        # plain step costs, measured. A draft whose passes cost like the target's is dropped at
        # the third step.
        if len(self.target_s) == 1 and self.STREAMED * self.draft_s > self.t_target(0):
            return 0, 0
        rates = self.rates()
        best = max(rates, key=rates.get)
        if best == (0, 0):
            best = self.look(rates, left)
        if best == (0, 0):
            return best
        return self.deepen(*best)

    def first_tree(self, trunk=1):
        """The first tree where passes were timed before it: an offloaded target (offload.py)
        times a pass over 128 tokens and one over one when auto first meets it (the CLI: as it
        loads), with the seconds of each not spent waiting for weights (its compute), and auto
        starts from them. The budget with the most tokens per second if a tree gives one token
        more each time it doubles (before any tree, the draft's worth is a guess; SpecExec's
        trees give about that), searched as deep as it may go: beside a streamed target's pass,
        a draft pass is cheap. Where the pass is the link's, whatever its size (the paper's
        regime), that is the biggest, deepest tree; where its compute grows with the tree, a
        small one. The pass reads the `trunk` first (the prompt): a long prompt, a smaller tree."""
        guess = {b: (1 + math.log2(b + 1)) / self.t_target(trunk + b) for b in self.BUDGETS}
        budget = max(guess, key=guess.get)
        return budget, min(budget, self.max_depth)

    def first_look(self, left):
        """The first tree where no pass was timed before it: `budget` nodes, `first_depth` deep
        (make_policy's). It is a look at the draft too, its passes priced by the weights they
        read (`draft_share`): not taken where they would cost more than 1 / LOOK_EVERY of the
        plain steps still to come (a dear draft over a short run: it could not pay back its first
        tree), and `why` says so."""
        max_depth = min(self.first_depth, self.max_depth)
        dear = self.LOOK_EVERY * max_depth * self.draft_share > left
        share = f"auto decoded plainly: a draft pass costs {self.draft_share:.0%} of a target's"
        self.why = share + ", too dear for so short a run" if dear else ""  # a longer one looks
        return (0, 0) if dear else (self.budget, max_depth)

    def look(self, rates, left):
        """Where plain decoding (budget 0: E = 1, no draft pass) rates best: the best tree step,
        if it is time to look at the draft's predictions again, else plain decoding.

        Once plain steps in a row have taken LOOK_EVERY times the most the best tree step could
        lose against a plain step (its seconds less a plain step's: it gives the bonus at
        least), one tree step looks, and each look doubles the wait for the next until a tree
        step beats a plain one (update): looking costs at most 1 / LOOK_EVERY of the time at
        first, and less as the run goes, however dear or wrong the draft (the target's own
        quantized copy costs what the target does). Nor does it look when the plain steps still
        to come would take less than that many looks: a draft found good so late has no time
        left to pay for the look. The first look comes at once after the first tree, whose draft
        passes were priced with the prompt read in the first of them (several times a later
        pass's cost for a small draft in memory)."""
        trees = [choice for choice in rates if choice[0]]
        if not trees:
            return 0, 0
        best_tree = max(trees, key=rates.get)
        plain = self.seconds((0, 0), 0)  # a plain step's
        wait = self.LOOK_EVERY * (self.seconds(best_tree, self.gains[best_tree][1]) - plain)
        waited = self.plain_s >= 2**self.looks * wait or self.tree_steps == 1
        if not (waited and left * plain >= wait):
            return 0, 0
        self.looks += 1
        return best_tree

    def deepen(self, budget, max_depth):
        """(budget, max_depth), or deeper: a deeper tree's gains are seen only by a tree searched
        that deep. While its best nodes reach the depth limit (their draft passes), the search
        goes as deep as 1 / LOOK_EVERY of the step buys in draft passes (a streamed target's
        trees go deep at once), or else one depth deeper every DEEPEN_EVERY tree steps: through
        DEPTHS, to the policy's max_depth, never past the budget (b nodes are never deeper than
        b)."""
        passes = self.gains[(budget, max_depth)][1]
        if passes <= max_depth - 1:  # its best nodes stop short of the limit
            return budget, max_depth
        limit = min(budget, self.max_depth)
        deeper = [d for d in self.DEPTHS if max_depth < d < limit] + [limit] * (max_depth < limit)
        spare = self.seconds((budget, max_depth), passes) / self.LOOK_EVERY
        added = {d: self.from_parts(budget, d) - self.from_parts(budget, passes) for d in deeper}
        cheap = [d for d in deeper if added[d] <= spare]
        if cheap:
            return budget, cheap[-1]
        if deeper and self.tree_steps % self.DEEPEN_EVERY == 0:
            return budget, deeper[0]
        return budget, max_depth
