"""The pictures of notebook.ipynb. Each function draws what the notebook computed with the real
modules (`specexec`, `offload`); nothing here runs a model or changes a library object."""

import math
import re

import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap, LogNorm
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

STYLE = {
    "figure.dpi": 100,
    "font.size": 10,
    "axes.titlesize": 11,
    "legend.fontsize": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
}


def show(tokenizer, token):
    """A token as one line of text: newline as ↵, a space as ␣, a run of n spaces as ␣×n."""
    text = tokenizer.decode([token]).replace("\n", "↵")
    return re.sub(" {2,}", lambda run: f"␣×{len(run.group())}", text).replace(" ", "␣")


# ---- the draft tree ----


def layered_layout(tree, kept):
    """(depth, row) of every node. Leaves are stacked in depth-first order, best child first;
    a parent sits level with the middle of its children; a dropped leaf takes less room."""
    children = {}
    for node in sorted(range(1, len(tree.tokens)), key=tree.rank):
        children.setdefault(tree.parents[node], []).append(node)
    pos, free_row = {}, 0.0

    def place(node, depth):
        nonlocal free_row
        for child in children.get(node, []):
            place(child, depth + 1)
        if node in children:
            first, last = children[node][0], children[node][-1]
            pos[node] = (depth, (pos[first][1] + pos[last][1]) / 2)
        else:
            pos[node] = (depth, free_row)
            free_row += 1.0 if node in kept else 0.3

    place(0, 0)
    return pos


def draw_tree(ax, tree, kept, pos, tokenizer, only=None):
    """Kept nodes as boxes coloured by cumulative draft probability; dropped ones as grey dots.
    With `only`, the nodes outside it are faded. Returns the boxes and the colour scale."""
    alpha = {node: 1.0 if only is None or node in only else 0.3 for node in range(len(tree.tokens))}
    prob = {node: math.exp(tree.cum_logprob[node]) for node in kept}
    norm, cmap = LogNorm(vmin=min(prob.values()), vmax=1.0), plt.get_cmap("viridis")
    for node in range(1, len(tree.tokens)):
        (x0, y0), (x1, y1) = pos[tree.parents[node]], pos[node]
        if node in kept:
            ax.plot([x0, x1], [y0, y1], color="0.35", lw=1.2, alpha=alpha[node], zorder=1)
        else:
            ax.plot([x0, x1], [y0, y1], color="0.75", lw=0.6, ls=":", alpha=alpha[node], zorder=0)
            ax.plot(x1, y1, "o", color="0.65", ms=3, alpha=alpha[node], zorder=1)
    boxes = {}
    for node in [0, *kept]:
        shade = norm(prob[node]) if node else 1.0  # the root is given: probability 1
        ink = "white" if shade < 0.55 else "black"
        boxes[node] = ax.text(
            *pos[node],
            show(tokenizer, tree.tokens[node]),
            ha="center",
            va="center",
            zorder=3,
            family="monospace",
            color=ink if alpha[node] == 1 else "0.3",
            bbox=dict(
                boxstyle="round,pad=0.3",
                fc="white" if node == 0 else cmap(shade),
                ec="black",
                lw=0.8,
                alpha=alpha[node],
            ),
        )
    ax.set_xticks(range(max(x for x, _ in pos.values()) + 1))
    ax.set_xlabel("depth: tokens after the root")
    ax.set_yticks([])
    ax.spines["left"].set_visible(False)
    ax.set_ylim(max(y for _, y in pos.values()) + 0.8, -0.8)  # best branch on top
    return boxes, norm, cmap


def plot_draft_tree(tree, kept, pass_of, tokenizer, opts):
    """The tree `grow_tree` found, with the number of the draft pass that read each node."""
    kept = {0, *kept}
    pos = layered_layout(tree, kept)
    fig, ax = plt.subplots(figsize=(11, 6))
    boxes, norm, cmap = draw_tree(ax, tree, kept, pos, tokenizer)
    bar = fig.colorbar(plt.cm.ScalarMappable(norm, cmap), ax=ax, shrink=0.7, pad=0.01)
    bar.set_label("cumulative draft probability of the path")
    ticks = [t for t in (0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 1) if t >= norm.vmin]
    bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    bar.minorticks_off()
    fig.canvas.draw()  # lays the boxes out, so a badge can sit on a box's bottom-left corner
    to_data = ax.transData.inverted()
    for node, number in pass_of.items():
        x, y = pos[node]
        if node in boxes:
            corners = boxes[node].get_bbox_patch().get_window_extent().get_points()
            corners = to_data.transform(corners)
            x, y = corners[:, 0].min(), corners[:, 1].min()
        badge = dict(boxstyle="circle,pad=0.2", fc="white", ec="crimson", lw=0.8)
        ink = dict(color="crimson", weight="bold", ha="center", va="center", fontsize=8)
        ax.text(x, y, number, bbox=badge, zorder=4, **ink)
    legend = [
        Line2D([], [], marker="s", ls="", mfc=cmap(0.5), mec="black", ms=9, label="kept node"),
        Line2D([], [], marker="o", ls=":", color="0.65", ms=4, label="found, dropped"),
        Line2D([], [], marker="$2$", ls="", color="crimson", ms=7, label="draft pass that read it"),
    ]
    ax.legend(handles=legend, loc="upper left", frameon=False)
    ax.set_title(
        f"grow_tree: the best {len(kept) - 1} of the {len(tree.tokens) - 1} nodes the draft "
        f"found (budget {opts.budget}, width {opts.width}, branch {opts.branch})"
    )
    return fig


# ---- the tree attention mask ----


def plot_mask(mask, positions, cached_tail, tree_tokens):
    """The mask's last len(cached_tail) cached columns and every tree row and column, one query
    row (the deepest node) coloured by why it may look at each key."""
    n_tree, shown = len(tree_tokens), len(cached_tail)
    visible = (mask[0, 0, :, -(shown + n_tree) :] == 0).int()  # (n_tree, shown + n_tree)
    row = int(positions[0].argmax())  # the deepest node
    image = visible.clone()  # 0 masked, 1 visible; the annotated row: 2 prefix, 3 ancestor, 4 self
    image[row, :shown] = 2
    image[row, shown:] = visible[row, shown:] * 3
    image[row, shown + row] = 4
    colours = ["white", "0.6", "tab:blue", "tab:orange", "crimson"]
    fig, ax = plt.subplots(figsize=(9, 6.4), layout="constrained")
    ax.imshow(image, cmap=ListedColormap(colours), vmin=-0.5, vmax=4.5)
    labels = cached_tail + tree_tokens
    ax.set_xticks(range(len(labels)), labels, rotation=90, family="monospace")
    rows = [f"{token} @{p}" for token, p in zip(tree_tokens, positions[0].tolist())]
    ax.set_yticks(range(n_tree), rows, family="monospace")
    ax.set_xticks([x - 0.5 for x in range(len(labels) + 1)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(n_tree + 1)], minor=True)
    ax.grid(which="minor", color="0.85", lw=0.5)
    ax.tick_params(which="minor", length=0)
    ax.axvline(shown - 0.5, color="black", lw=1.5)
    n_cached = mask.shape[-1] - n_tree
    ax.set_xlabel(f"keys: the last {shown} of {n_cached} cached tokens | the root and kept nodes")
    ax.set_ylabel("queries: the root and kept nodes, @ position id")
    names = ["may attend", "prefix (the cache)", "its ancestors", "itself"]
    ax.legend(
        handles=[Patch(fc=c, ec="0.5", label=name) for c, name in zip(colours[1:], names)],
        title=f"row {row}: what {tree_tokens[row]!r} sees",
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        frameon=False,
    )
    ax.set_title(f"tree_mask for the tree above ({n_tree} tokens after {n_cached} cached)")
    return fig


# ---- verification and acceptance ----


def plot_verification(tree, kept, logits, path, bonus, tokenizer):
    """The walk `accept` made: the target's greedy pick at each node on it, the accepted path
    and the bonus token."""
    kept_set, walk = {0, *kept}, [0, *path]
    row_of = {node: i for i, node in enumerate([0, *kept])}  # each node's row of `logits`
    pos = layered_layout(tree, kept_set)
    fig, ax = plt.subplots(figsize=(11, 6.4))
    boxes, _, _ = draw_tree(ax, tree, kept_set, pos, tokenizer, only=set(walk))
    ax.set_xticks(range(max(x for x, _ in pos.values()) + 2))  # room for the bonus
    for node in walk:
        boxes[node].get_bbox_patch().set(lw=2, ec="crimson")
    for parent, child in zip(walk, walk[1:]):
        ax.plot(*zip(pos[parent], pos[child]), color="crimson", lw=4, zorder=2)
    # Above the tree, one column per depth: the target's pick at the path's node of that depth
    top = min(y for _, y in pos.values()) - 1.6
    for node in walk:
        pick, found = show(tokenizer, int(logits[row_of[node]].argmax())), node != walk[-1]
        ax.text(
            pos[node][0],
            top,
            f"picks\n{pick} " + ("✓" if found else "✗"),
            ha="center",
            va="center",
            weight="bold",
            color="darkgreen" if found else "darkorange",
        )
    # The bonus goes one depth further, on the last node's row unless a node is drawn there
    x, y = pos[walk[-1]]
    if any(px == x + 1 and abs(py - y) < 0.9 for px, py in pos.values()):
        y = max(py for _, py in pos.values()) + 1
        ax.set_ylim(y + 0.8, ax.get_ylim()[1])
    ax.plot([x, x + 1], [pos[walk[-1]][1], y], color="darkorange", lw=3, ls="--", zorder=2)
    ax.text(
        x + 1,
        y,
        show(tokenizer, bonus),
        ha="center",
        va="center",
        family="monospace",
        zorder=3,
        bbox=dict(boxstyle="round,pad=0.3", fc="gold", ec="darkorange", lw=2),
    )
    ax.set_ylim(ax.get_ylim()[0], top - 0.7)
    legend = [
        Line2D([], [], color="crimson", lw=4, label="accepted path: the target's picks"),
        Line2D([], [], color="darkorange", lw=3, ls="--", label="bonus: its pick at the last node"),
        Line2D(
            [],
            [],
            marker="$✓$",
            ls="",
            color="darkgreen",
            ms=8,
            label="top row: the target's pick at each depth: a child ✓ or not ✗",
        ),
    ]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    ax.set_title(
        f"verify + accept (greedy): {len(path)} accepted + 1 bonus = {len(walk)} tokens from ONE "
        "target pass",
        pad=16,
    )
    return fig


# ---- budget "auto": the cost model ----


def plot_cost_model(passes, cost, measured, predicted, choice, title):
    """Three panels: what a target pass costs (every pass measured, and the cost model's
    line), tokens per step (predicted against measured) and tokens per second per budget.

    passes: [(tokens fed, seconds)]; cost: auto's CostModel; measured: {budget: Stats}, budget 0
    plain decoding, "auto" auto's run; predicted: {budget: (tokens per step, tokens/s)};
    choice: (budget, depth, steps) auto chose most often.
    """
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 4.6), layout="constrained")
    fig.suptitle(title)
    fed, seconds = zip(*passes)
    left.plot(
        fed,
        [s * 1e3 for s in seconds],
        ".",
        color="0.6",
        ms=4,
        label="every target pass of the sweep",
    )
    sizes = range(1, max(fed) + 1)
    left.plot(
        sizes,
        [cost.t_target(n) * 1e3 for n in sizes],
        color="tab:red",
        label="auto's cost model: t_target(n)",
    )
    points = sorted(cost.target_s.items())
    left.plot(
        [n for n, _ in points],
        [s * 1e3 for _, s in points],
        "o",
        color="tab:red",
        mfc="none",
        label="sizes auto ran",
    )
    for ax in (left, middle):
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 4, 16, 64, 256], ["1", "4", "16", "64", "256"])
    left.set_xlabel("tokens fed to the target in one pass")
    left.set_ylabel("ms per pass")
    left.set_title("Cost: one target pass (in memory)")
    left.legend(frameon=False)

    budgets = [b for b in measured if b not in (0, "auto")]
    middle.plot(
        budgets,
        [measured[b].tokens_per_step for b in budgets],
        "o-",
        color="black",
        label="measured: fixed budget",
    )
    middle.plot(
        list(predicted),
        [g for g, _ in predicted.values()],
        "s--",
        color="tab:blue",
        label="predicted by the cost model",
    )
    middle.set_xlabel("budget b (depth 16, or b if less)")
    middle.set_ylabel("tokens per target pass")
    middle.set_title("Gain: tokens per step")
    middle.legend(frameon=False)

    x = {0: 0, **{b: 1 + math.log2(b) for b in [*budgets, *predicted]}}  # plain decoding at 0
    right.plot(
        [x[b] for b in [0, *budgets]],
        [measured[b].tokens_per_second for b in [0, *budgets]],
        "o-",
        color="black",
        label="measured: fixed budget",
    )
    right.plot(
        [x[b] for b in predicted],
        [r for _, r in predicted.values()],
        "s--",
        color="tab:blue",
        label="predicted (depth 16, or b)",
    )
    auto = measured["auto"]
    right.axhline(auto.tokens_per_second, color="tab:red", ls=":", label="auto, measured")
    budget, depth, steps = choice
    right.plot(
        x.get(budget, 1 + math.log2(max(1, budget))),
        auto.tokens_per_second,
        "*",
        color="tab:red",
        ms=16,
        label=f"auto's usual choice: {f'budget {budget}, depth {depth}' if budget else 'plain'}"
        f" ({steps} of {auto.steps} steps)",
    )
    ticks = sorted(set(x.values()))
    right.set_xticks(ticks, ["plain" if t == 0 else str(2 ** int(t - 1)) for t in ticks])
    right.set_ylim(bottom=0)
    right.set_xlabel("budget (0: plain decoding)")
    right.set_ylabel("tokens per second")
    right.set_title("Speed: tokens/s, this CPU, in memory")
    right.legend(frameon=False, loc="lower left")
    return fig


# ---- offloading ----


def plot_pass_cost(tiers, title):
    """ms per target pass against tokens in it, per tier: {tier: {tokens: (pass s, wait s)}}."""
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    for (tier, cost), colour in zip(tiers.items(), ("tab:gray", "tab:red", "tab:orange")):
        sizes = sorted(cost)
        ax.plot(sizes, [cost[n][0] * 1e3 for n in sizes], "o-", color=colour, label=tier)
        if any(wait for _, wait in cost.values()):
            ax.plot(
                sizes,
                [cost[n][1] * 1e3 for n in sizes],
                ":",
                color=colour,
                label=f"{tier}: of which waiting for weights",
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("tokens in the pass")
    ax.set_ylabel("ms per pass")
    ax.set_title(title)
    ax.legend(frameon=False)
    return fig
