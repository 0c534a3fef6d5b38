"""The pictures of notebook.ipynb. Each function draws what the notebook computed with the real
modules (`specexec`, `offload`); nothing here runs a model or changes a library object."""

import math
import re

import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap, LogNorm
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

STYLE = {"axes.titlesize": 11, "legend.fontsize": 9, "legend.frameon": False}
STYLE |= {f"axes.spines.{side}": False for side in ("top", "right")}  # no box around a plot
CENTRED = dict(ha="center", va="center")


def show(tokenizer, token):
    """A token as one line of text: newline as ↵, a space as ␣, a run of n spaces as ␣×n."""
    text = tokenizer.decode([token]).replace("\n", "↵")
    return re.sub(" {2,}", lambda run: f"␣×{len(run.group())}", text).replace(" ", "␣")


def in_ms(seconds):
    return [s * 1e3 for s in seconds]


def log_budget(budget):
    """Where a budget goes on a log axis: 1 + log2(budget), plain decoding (budget 0) at 0."""
    return 1 + math.log2(budget) if budget else 0


# ---- the draft tree ----


def layered_layout(tree, best):
    """(depth, row) of every node. Leaves are stacked in depth-first order, best child first;
    a parent sits level with the middle of its children; a leaf not in `best` takes less room."""
    children = {}
    for node in sorted(range(1, len(tree.tokens)), key=tree.rank):
        children.setdefault(tree.parents[node], []).append(node)
    pos = {}
    free_row = 0.0

    def place(node, depth):  # returns the node's row
        nonlocal free_row
        rows = [place(child, depth + 1) for child in children.get(node, [])]
        if rows:
            pos[node] = (depth, (rows[0] + rows[-1]) / 2)
        else:
            pos[node] = (depth, free_row)
            free_row += 1.0 if node in best else 0.3
        return pos[node][1]

    place(0, 0)
    return pos


def token_box(ax, xy, text, ink="black", **box):
    """A token in a rounded box centred on xy (data coordinates)."""
    box = dict(boxstyle="round,pad=0.3", ec="black", lw=0.8) | box
    return ax.text(*xy, text, color=ink, family="monospace", zorder=3, bbox=box, **CENTRED)


def draw_tree(ax, tree, best, pos, tokenizer, only=None):
    """The `best` nodes as boxes coloured by cumulative draft probability; the others as grey
    dots. With `only`, the nodes outside it are faded. Returns the boxes and the colour scale."""
    alpha = {node: 1.0 if only is None or node in only else 0.3 for node in range(len(tree.tokens))}
    prob = {node: math.exp(tree.cum_logprob[node]) for node in best}
    norm = LogNorm(vmin=min(prob.values()), vmax=1.0)
    cmap = plt.get_cmap("viridis")
    dropped = dict(color="0.7", lw=0.6, ls=":", marker="o", ms=3, markevery=[1], zorder=0)
    for node in range(1, len(tree.tokens)):
        style = dict(color="0.35", lw=1.2, zorder=1) if node in best else dropped
        ax.plot(*zip(pos[tree.parents[node]], pos[node]), alpha=alpha[node], **style)
    boxes = {}
    for node in sorted(best):
        shade = norm(prob[node])  # the root is given: probability 1
        ink = ("white" if shade < 0.55 else "black") if alpha[node] == 1 else "0.3"
        fill = "white" if node == 0 else cmap(shade)
        text = show(tokenizer, tree.tokens[node])
        boxes[node] = token_box(ax, pos[node], text, ink, fc=fill, alpha=alpha[node])
    deepest = max(x for x, _ in pos.values())
    ax.set(xticks=range(deepest + 1), yticks=[], xlabel="depth: tokens after the root")
    ax.set_ylim(max(y for _, y in pos.values()) + 0.8, -0.8)  # best branch on top
    ax.spines["left"].set_visible(False)
    return boxes, norm, cmap


def plot_draft_tree(tree, best, pass_of, tokenizer, opts):
    """The tree `grow_tree` found, its `best` nodes (tree.best()) boxed, with the number of the
    draft pass that read each node."""
    with_root = {0, *best}
    pos = layered_layout(tree, with_root)
    fig, ax = plt.subplots(figsize=(11, 6))
    boxes, norm, cmap = draw_tree(ax, tree, with_root, pos, tokenizer)
    label = "cumulative draft probability of the path"
    bar = fig.colorbar(plt.cm.ScalarMappable(norm, cmap), ax=ax, shrink=0.7, pad=0.01, label=label)
    ticks = [t for t in (0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 1) if t >= norm.vmin]
    bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    bar.minorticks_off()
    badge = dict(color="crimson", weight="bold", fontsize=8, zorder=4, textcoords="offset points")
    badge |= dict(bbox=dict(boxstyle="circle,pad=0.2", fc="white", ec="crimson", lw=0.8), **CENTRED)
    for node, number in pass_of.items():  # just off a box's bottom-left corner, or a dropped dot
        at = dict(xy=(0, 0), xycoords=boxes[node]) if node in boxes else dict(xy=pos[node])
        ax.annotate(number, **at, xytext=(-3, -3), **badge)
    legend = [
        Line2D([], [], marker="s", ls="", mfc=cmap(0.5), mec="black", ms=9, label="best node"),
        Line2D([], [], marker="o", ls=":", color="0.65", ms=4, label="found, dropped"),
        Line2D([], [], marker="$2$", ls="", color="crimson", ms=7, label="draft pass that read it"),
    ]
    ax.legend(handles=legend, loc="upper left")
    ax.set_title(
        f"grow_tree: the best {len(best)} of the {len(tree.tokens) - 1} nodes the draft "
        f"found (budget {opts.budget}, width {opts.width}, branch {opts.branch})"
    )
    return fig


# ---- the tree attention mask ----


def plot_mask(mask, positions, cached_tail, tree_tokens):
    """The mask's last len(cached_tail) cached columns and every tree row and column, one query
    row (the deepest node) coloured by why it may look at each key."""
    n_tree = len(tree_tokens)
    shown = len(cached_tail)
    n_prefix = mask.shape[-1] - n_tree
    image = (mask[0, 0, :, -(shown + n_tree) :] == 0).int()  # (n_tree, shown + n_tree)
    row = int(positions[0].argmax())  # the deepest node
    # 0 masked, 1 visible; the annotated row: 2 prefix, 3 ancestor, 4 self
    image[row, :shown] = 2
    image[row, shown:] *= 3
    image[row, shown + row] = 4
    colours = ["white", "0.6", "tab:blue", "tab:orange", "crimson"]
    fig, ax = plt.subplots(figsize=(9, 6.4), layout="constrained")
    # one square cell per (query, key), outlined; query 0 on top
    ax.pcolormesh(image, cmap=ListedColormap(colours), vmin=-0.5, vmax=4.5, ec="0.85", lw=0.5)
    ax.set(aspect="equal", ylim=(n_tree, 0))
    labels = cached_tail + tree_tokens
    ax.set_xticks([x + 0.5 for x in range(len(labels))], labels, rotation=90, family="monospace")
    rows = [f"{token} @{p}" for token, p in zip(tree_tokens, positions[0].tolist())]
    ax.set_yticks([y + 0.5 for y in range(n_tree)], rows, family="monospace")
    ax.axvline(shown, color="black", lw=1.5)
    ax.set_xlabel(f"keys: the last {shown} of {n_prefix} cached tokens | the root and best nodes")
    ax.set_ylabel("queries: the root and best nodes, @ position id")
    names = ["may attend", "prefix (the cache)", "its ancestors", "itself"]
    legend = [Patch(fc=c, ec="0.5", label=name) for c, name in zip(colours[1:], names)]
    title = f"row {row}: what {tree_tokens[row]!r} sees"
    ax.legend(handles=legend, title=title, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(f"tree_mask for the tree above ({n_tree} tokens after {n_prefix} cached)")
    return fig


# ---- verification and acceptance ----


def plot_verification(tree, best, logits, path, bonus, tokenizer):
    """The walk `accept` made over the `best` nodes: the target's greedy pick at each node on it,
    the accepted path and the bonus token."""
    walk = [0, *path]
    row_of = {node: i for i, node in enumerate([0, *best])}  # each node's row of `logits`
    pos = layered_layout(tree, set(row_of))
    # The bonus goes one depth past the path's last node, on a row of its own below the tree
    pos["bonus"] = (pos[walk[-1]][0] + 1, max(y for _, y in pos.values()) + 1)
    fig, ax = plt.subplots(figsize=(11, 6.4))
    boxes, _, _ = draw_tree(ax, tree, set(row_of), pos, tokenizer, only=set(walk))
    ax.plot(*zip(*[pos[node] for node in walk]), color="crimson", lw=4, zorder=2)
    ax.plot(*zip(pos[walk[-1]], pos["bonus"]), color="darkorange", lw=3, ls="--", zorder=2)
    token_box(ax, pos["bonus"], show(tokenizer, bonus), fc="gold", ec="darkorange", lw=2)
    # Above the tree, one column per depth: the target's pick at the path's node of that depth
    top = min(y for _, y in pos.values()) - 1.6
    for node in walk:
        boxes[node].get_bbox_patch().set(lw=2, ec="crimson")  # the walk's nodes outlined
        pick = show(tokenizer, int(logits[row_of[node]].argmax()))
        found = node != walk[-1]  # a child: the walk goes on
        mark = "✓" if found else "✗"
        ink = "darkgreen" if found else "darkorange"
        ax.text(pos[node][0], top, f"picks\n{pick} {mark}", weight="bold", color=ink, **CENTRED)
    ax.set_ylim(ax.get_ylim()[0], top - 0.7)
    check = "top row: the target's pick at each depth: a child ✓ or not ✗"
    legend = [
        Line2D([], [], color="crimson", lw=4, label="accepted path: the target's picks"),
        Line2D([], [], color="darkorange", lw=3, ls="--", label="bonus: its pick at the last node"),
        Line2D([], [], marker="$✓$", ls="", color="darkgreen", ms=8, label=check),
    ]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    title = f"verify + accept (greedy): {len(path)} accepted + 1 bonus = {len(walk)} tokens"
    ax.set_title(title + " from ONE target pass", pad=16)
    return fig


# ---- budget "auto": the cost model ----


def plot_cost_model(passes, cost, measured, predicted, choice, title):
    """Three panels: what a target pass costs (every pass measured, and the cost model's
    line), tokens per step (predicted against measured) and tokens per second per budget.

    passes: [(tokens fed, seconds)]; cost: auto's CostModel; measured: {budget: Stats}, budget 0
    plain decoding, "auto" auto's run; predicted: {budget: (tokens per step, tokens/s)};
    choice: (budget, max_depth, steps) auto chose most often.
    """
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 4.6), layout="constrained")
    fig.suptitle(title)
    fed, seconds = zip(*passes)
    left.plot(fed, in_ms(seconds), ".", color="0.6", ms=4, label="every target pass of the sweep")
    sizes = range(1, max(fed) + 1)
    model = in_ms(map(cost.t_target, sizes))
    left.plot(sizes, model, color="tab:red", label="auto's cost model: t_target(n)")
    ran, ran_s = zip(*sorted(cost.target_s.items()))
    left.plot(ran, in_ms(ran_s), "o", color="tab:red", mfc="none", label="sizes auto ran")
    left.set_xscale("log", base=2)
    left.set_xticks([1, 4, 16, 64, 256], ["1", "4", "16", "64", "256"])
    left.set(xlabel="tokens fed to the target in one pass", ylabel="ms per pass")
    left.set_title("Cost: one target pass (in memory)")
    left.legend()

    # The gain and the speed against the budget on a log scale, plain decoding (no tree) at 0
    budgets = sorted(b for b in measured if b != "auto")
    xs = [log_budget(b) for b in budgets]
    panels = [
        (middle, "tokens_per_step", "tokens per target pass", "Gain: tokens per step"),
        (right, "tokens_per_second", "tokens per second", "Speed: tokens/s, this CPU, in memory"),
    ]
    for i, (ax, figure, ylabel, title) in enumerate(panels):
        ys = [getattr(measured[b], figure) for b in budgets]
        ax.plot(xs, ys, "o-", color="black", label="measured: fixed budget")
        ys = [p[i] for p in predicted.values()]
        label = "predicted by the cost model (max_depth 16, or b)"
        ax.plot([log_budget(b) for b in predicted], ys, "s--", color="tab:blue", label=label)
        ax.set_xticks(xs, [str(b) if b else "plain" for b in budgets])
        ax.set(xlabel="budget (0: plain decoding)", ylabel=ylabel, title=title, ylim=(0, None))
    auto = measured["auto"]
    right.axhline(auto.tokens_per_second, color="tab:red", ls=":", label="auto, measured")
    budget, max_depth, steps = choice
    usual = f"budget {budget}, max_depth {max_depth}" if budget else "plain"
    label = f"auto's usual choice: {usual} ({steps} of {auto.steps} steps)"
    right.plot(log_budget(budget), auto.tokens_per_second, "*", color="tab:red", ms=16, label=label)
    right.set_ylim(0, max(right.get_ylim()[1], 1.1 * auto.tokens_per_second))  # auto's in view
    middle.legend(loc="lower right")
    right.legend(loc="lower left")
    return fig


# ---- offloading ----


def plot_pass_cost(tiers, title):
    """ms per target pass against tokens in it, per tier: {tier: {tokens: (pass s, wait s)}}."""
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    for (tier, cost), colour in zip(tiers.items(), ("tab:gray", "tab:red", "tab:orange")):
        sizes = sorted(cost)
        passes, waits = zip(*(cost[n] for n in sizes))
        ax.plot(sizes, in_ms(passes), "o-", color=colour, label=tier)
        if any(waits):
            label = f"{tier}: of which waiting for weights"
            ax.plot(sizes, in_ms(waits), ":", color=colour, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set(ylim=(0, None), xlabel="tokens in the pass", ylabel="ms per pass", title=title)
    ax.legend()
    return fig
