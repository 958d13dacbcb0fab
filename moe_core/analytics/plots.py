"""Pictures of a router profile: a PNG (matplotlib, for MLflow and reports) and an interactive HTML (plotly)
of each.

- expert load heatmap (MoE layer x expert, share of kept slots);
- co-activation matrices (per layer, fraction of tokens using both experts);
- routing flow between consecutive MoE layers (top-1 flow: plotly Sankey; the PNG draws the same flow as
  weighted lines between layer columns, since a static Sankey export needs kaleido);
- specialization (per layer, each expert's kept slots by token class, and by domain when known);
- token-to-expert heatmap over a piece of text (router probabilities per token, kept slots marked).

Each function returns a `Plot`: the matplotlib figure (``.figure``) and the plotly one (``.interactive``),
shown inline in a notebook; given ``out_dir`` it also writes ``<name>.png`` and ``<name>.html`` there
(``plot["png"]``, ``plot["html"]``). HTML files load ``plotly.min.js`` from the same directory
(``include_plotlyjs="directory"``, written once), so they open offline; `portable_copies` makes versions for
viewers that serve each file alone (MLflow's artifact viewer). PNGs are drawn on a bare
`matplotlib.figure.Figure` (Agg canvas): no pyplot global state, no display needed.

Legend: L = MoE layers, E = experts, C = token classes, T = tokens of the text.
"""

from __future__ import annotations

import io
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import torch
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from plotly.subplots import make_subplots

from moe_core.analytics.profile import RouterProfile
from moe_core.analytics.token_routing import route_tokens
from moe_core.eval.prompts import PROMPTS


def _figure(width: float, height: float):
    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _write_html(fig, path: Path) -> Path:
    fig.write_html(path, include_plotlyjs="directory", full_html=True)
    return path


class Plot(Mapping):
    """One picture: ``figure`` (matplotlib, static) and ``interactive`` (plotly). Displays inline in a
    notebook (the PNG; ``plot.interactive`` for the zoomable one). As a mapping: the files written
    (``plot["png"]``, ``plot["html"]``), empty until `save`."""

    def __init__(self, name: str, figure, interactive) -> None:
        self.name, self.figure, self.interactive = name, figure, interactive
        self.files: dict[str, Path] = {}

    def save(self, out_dir: str | Path) -> Plot:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        png, html = out_dir / f"{self.name}.png", out_dir / f"{self.name}.html"
        self.figure.savefig(png)
        self.files = {"png": png, "html": _write_html(self.interactive, html)}
        return self

    def png_bytes(self) -> bytes:
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png")
        return buffer.getvalue()

    def _repr_png_(self) -> bytes:
        return self.png_bytes()

    def __getitem__(self, key: str) -> Path:
        return self.files[key]

    def __iter__(self):
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def __repr__(self) -> str:
        return f"Plot({self.name!r}, files={ {k: str(v) for k, v in self.files.items()} })"


def _finish(name: str, figure, interactive, out_dir: str | Path | None) -> Plot:
    plot = Plot(name, figure, interactive)
    return plot.save(out_dir) if out_dir is not None else plot


def portable_copies(plots_dir: str | Path, dest: str | Path) -> Path:
    """Copies of ``plots_dir``'s pictures that render where each file is served alone: MLflow's artifact
    viewer loads an HTML artifact as a blob, where the relative ``plotly.min.js`` never loads (a blank page).
    The HTML copies load plotly.js from its CDN instead (the pinned version, with its integrity hash; 10 KB
    per page rather than a 4.8 MB inlined copy; interactive when the viewer's browser is online), and the PNG
    beside each shows the same picture offline. Returns ``dest``."""
    plots_dir, dest = Path(plots_dir), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cdn_tag = _cdn_script_tag()
    for path in sorted(plots_dir.iterdir()):
        if path.suffix == ".png":
            shutil.copyfile(path, dest / path.name)
        elif path.suffix == ".html":
            text = re.sub(r'<script charset="utf-8" src="plotly\.min\.js">', cdn_tag, path.read_text())
            (dest / path.name).write_text(text)
    return dest


def _cdn_script_tag() -> str:
    """The ``<script ...>`` opening tag plotly writes for ``include_plotlyjs="cdn"`` (version and hash of the
    installed plotly.js)."""
    html = go.Figure().to_html(include_plotlyjs="cdn", full_html=False)
    return re.search(r"<script[^>]*src=\"https://[^>]*>", html).group(0)


def _layer_labels(profile: RouterProfile) -> list[str]:
    return [f"layer {x.layer_id}" for x in profile.layers]


# ------------------------------------------------------------------------------------------------ load
def plot_expert_load(profile: RouterProfile, out_dir: str | Path | None = None) -> Plot:
    """Heatmap of each expert's share of its layer's kept slots (1/E is perfect balance)."""
    share_LE = profile.load_matrix_LE()
    L, E = share_LE.shape
    labels = _layer_labels(profile)
    fig = _figure(max(5.0, 0.45 * E + 2.5), max(2.5, 0.5 * L + 1.5))
    ax = fig.add_subplot()
    image = ax.imshow(share_LE, aspect="auto", cmap="viridis", vmin=0.0)
    ax.set(
        xlabel="expert",
        ylabel="MoE layer",
        xticks=range(E),
        yticks=range(L),
        yticklabels=labels,
        title=f"Expert load (share of kept slots; uniform = {1 / E:.3f})",
    )
    if L * E <= 256:
        for i in range(L):
            for j in range(E):
                ax.text(
                    j,
                    i,
                    f"{share_LE[i, j]:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if share_LE[i, j] < share_LE.max() * 0.6 else "black",
                )
    fig.colorbar(image, ax=ax, label="share of the layer's kept slots")
    hover = [
        [
            f"{labels[i]}, expert {j}<br>share {share_LE[i, j]:.4f}<br>slots {profile.layers[i].kept_E[j]}"
            for j in range(E)
        ]
        for i in range(L)
    ]
    pfig = go.Figure(
        go.Heatmap(
            z=share_LE,
            x=list(range(E)),
            y=labels,
            colorscale="Viridis",
            zmin=0.0,
            text=hover,
            hoverinfo="text",
            colorbar={"title": {"text": "share of the layer's kept slots"}},
        )
    )
    pfig.update_layout(
        title="Expert load (share of kept slots)", xaxis_title="expert", yaxis_title="MoE layer"
    )
    return _finish("expert_load", fig, pfig, out_dir)


# ------------------------------------------------------------------------------------------------ co-activation
def coactivation_fraction(profile: RouterProfile) -> list[np.ndarray]:
    """Per layer ``[E, E]``: fraction of tokens whose kept slots include both experts (diagonal: expert used)."""
    return [x.coactivation_EE / max(x.tokens, 1) for x in profile.layers]


def plot_coactivation(profile: RouterProfile, out_dir: str | Path | None = None) -> Plot:
    """Per layer, the fraction of tokens routed to both experts i and j, on one colour scale. A top-1 router's
    map is the diagonal by construction (a token has one expert): the figure says so instead of drawing it."""
    mats = coactivation_fraction(profile)
    labels = _layer_labels(profile)
    if profile.model.get("experts_per_token") == 1 and profile.model.get("router") != "expert_choice":
        note = "Co-activation: top-1 routing sends each token to one expert, so no two experts share a token"
        fig = _figure(6.0, 1.2)
        fig.text(0.5, 0.5, note, ha="center", va="center")
        pfig = go.Figure().update_layout(title=note)
        return _finish("coactivation", fig, pfig, out_dir)
    n = len(mats)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig = _figure(4.2 * cols, 3.8 * rows)
    axes = fig.subplots(rows, cols, squeeze=False)
    vmax = max(float(m.max()) for m in mats) if mats else 1.0
    for k, ax in enumerate(axes.flat):
        if k >= n:
            ax.set_axis_off()
            continue
        image = ax.imshow(mats[k], cmap="magma", vmin=0.0, vmax=vmax)
        ax.set(title=labels[k], xlabel="expert j", ylabel="expert i")
    fig.suptitle("Co-activation: fraction of tokens routed to both experts")
    fig.colorbar(image, ax=axes, label="fraction of tokens")
    pfig = make_subplots(rows=rows, cols=cols, subplot_titles=labels)
    for k, mat in enumerate(mats):
        pfig.add_trace(
            go.Heatmap(
                z=mat, coloraxis="coloraxis", hovertemplate="expert %{y} & %{x}: %{z:.4f}<extra></extra>"
            ),
            row=k // cols + 1,
            col=k % cols + 1,
        )
    pfig.update_layout(
        title="Co-activation (fraction of tokens routed to both experts)",
        coloraxis={
            "colorscale": "Magma",
            "cmin": 0.0,
            "cmax": vmax,
            "colorbar": {"title": {"text": "fraction of tokens"}},
        },
    )
    return _finish("coactivation", fig, pfig, out_dir)


# ------------------------------------------------------------------------------------------------ flow
def plot_routing_flow(
    profile: RouterProfile, out_dir: str | Path | None = None, min_share: float = 0.0
) -> Plot:
    """Top-1 routing flow between consecutive MoE layers; links under ``min_share`` of tokens are hidden."""
    layers = profile.layers
    E = max((x.num_experts for x in layers), default=0)
    node_index = {}
    labels, node_x, node_y = [], [], []
    for li, x in enumerate(layers):
        for e in range(x.num_experts):
            node_index[(x.layer_id, e)] = len(labels)
            labels.append(f"L{x.layer_id} e{e}")
            node_x.append(0.01 + 0.98 * li / max(len(layers) - 1, 1))
            node_y.append(0.01 + 0.98 * e / max(x.num_experts - 1, 1))
    sources, targets, values = [], [], []
    for f in profile.flows:
        total = max(int(f.top1_EF.sum()), 1)
        for i, j in zip(*np.nonzero(f.top1_EF)):
            if f.top1_EF[i, j] / total >= min_share:
                sources.append(node_index[(f.from_layer, int(i))])
                targets.append(node_index[(f.to_layer, int(j))])
                values.append(int(f.top1_EF[i, j]))

    fig = _figure(max(5.0, 2.2 * len(layers) + 1), max(3.5, 0.4 * E + 1.5))
    ax = fig.add_subplot()
    colors = _palette(E)
    for f in profile.flows:
        column = next(k for k, layer in enumerate(layers) if layer.layer_id == f.from_layer)
        total = max(int(f.top1_EF.sum()), 1)
        widest = max(int(f.top1_EF.max()), 1)
        for i, j in zip(*np.nonzero(f.top1_EF)):
            if f.top1_EF[i, j] / total < min_share:
                continue
            ax.plot(
                [column, column + 1],
                [i, j],
                color=colors[int(i)],
                alpha=0.55,
                linewidth=0.5 + 7.5 * f.top1_EF[i, j] / widest,
                solid_capstyle="butt",
            )
    for li, x in enumerate(layers):
        ax.scatter(
            [li] * x.num_experts,
            range(x.num_experts),
            s=30 + 400 * x.share_E,
            c=colors[: x.num_experts],
            edgecolors="black",
            linewidths=0.5,
            zorder=3,
        )
    ax.set(
        xticks=range(len(layers)),
        xticklabels=_layer_labels(profile),
        yticks=range(E),
        ylabel="expert",
        title="Routing flow: top-1 expert in layer l -> top-1 expert in layer l+1 (width ~ tokens)",
    )
    ax.invert_yaxis()
    link_colors = [_rgba(colors[[k for k, v in node_index.items() if v == s][0][1]], 0.45) for s in sources]
    pfig = go.Figure(
        go.Sankey(
            arrangement="fixed",
            node={"label": labels, "x": node_x, "y": node_y, "pad": 8, "thickness": 14},
            link={"source": sources, "target": targets, "value": values, "color": link_colors},
        )
    )
    pfig.update_layout(title="Routing flow (top-1 expert, consecutive MoE layers)")
    return _finish("routing_flow", fig, pfig, out_dir)


def _palette(n: int) -> list[tuple[float, float, float, float]]:
    cmap = colormaps["tab20" if n > 10 else "tab10"]
    return [cmap(i % cmap.N) for i in range(max(n, 1))]


def _rgba(color, alpha: float) -> str:
    r, g, b = (int(255 * c) for c in color[:3])
    return f"rgba({r},{g},{b},{alpha})"


# ------------------------------------------------------------------------------------------------ specialization
def plot_specialization(profile: RouterProfile, out_dir: str | Path | None = None) -> Plot:
    """Per layer, each expert's kept slots split by token class (and by domain): stacked shares, with the
    mutual information I(expert; class) in the title. Without class or domain data the chart says so."""
    panels = []  # (title, names, counts_EC)
    for x in profile.layers:
        if profile.class_names:
            panels.append(
                (
                    f"layer {x.layer_id}: token class, I = {x.mi_class_bits:.3f} bits",
                    profile.class_names,
                    x.class_counts_EC,
                )
            )
        if profile.domain_names:
            panels.append(
                (
                    f"layer {x.layer_id}: domain, I = {x.mi_domain_bits:.3f} bits",
                    profile.domain_names,
                    x.domain_counts_EM,
                )
            )
    n = max(len(panels), 1)
    cols = 2 if profile.class_names and profile.domain_names else 1
    rows = -(-n // cols)
    E = max((x.num_experts for x in profile.layers), default=1)
    fig = _figure(max(6.0, 0.5 * E + 3) * cols, 3.2 * rows)
    axes = fig.subplots(rows, cols, squeeze=False)
    pfig = make_subplots(
        rows=rows, cols=cols, subplot_titles=[title for title, _, _ in panels] or ["no data"]
    )
    for k, ax in enumerate(axes.flat):
        if k >= len(panels):
            ax.set_axis_off()
            if not panels:
                ax.text(0.5, 0.5, "no token classes or domains in this profile", ha="center", va="center")
            continue
        title, names, counts_EC = panels[k]
        share_EC = counts_EC / np.maximum(counts_EC.sum(1, keepdims=True), 1)
        colors = _palette(len(names))
        bottom = np.zeros(share_EC.shape[0])
        for c, name in enumerate(names):
            ax.bar(range(share_EC.shape[0]), share_EC[:, c], bottom=bottom, color=colors[c], label=name)
            pfig.add_trace(
                go.Bar(
                    x=list(range(share_EC.shape[0])),
                    y=share_EC[:, c],
                    name=name,
                    marker_color=_rgba(colors[c], 1.0),
                    legendgroup=name,
                    showlegend=k < cols,
                    customdata=counts_EC[:, c],
                    hovertemplate=f"expert %{{x}}, {name}: %{{y:.3f}} (%{{customdata}} slots)<extra></extra>",
                ),
                row=k // cols + 1,
                col=k % cols + 1,
            )
            bottom += share_EC[:, c]
        ax.set(
            title=title,
            xlabel="expert",
            ylabel="share of slots",
            ylim=(0, 1),
            xticks=range(share_EC.shape[0]),
        )
        if k < cols:  # one legend per column, outside the bars
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.suptitle("Expert specialization")
    pfig.update_layout(barmode="stack", title="Expert specialization (share of each expert's slots)")
    return _finish("specialization", fig, pfig, out_dir)


# ------------------------------------------------------------------------------------------------ token routing
@torch.no_grad()
def plot_token_routing(
    model,
    token_ids: list[int] | torch.Tensor,
    out_dir: str | Path | None = None,
    tokenizer=None,
    max_tokens: int = 64,
) -> dict[str, Path]:
    """Router probabilities of each token of a short text, per MoE layer (rows: experts, columns: tokens);
    kept slots are outlined. Give a project-owned text (e.g. a `moe_core.eval.prompts` prompt), not
    training data: the tokens are drawn as labels."""
    ids_T = torch.as_tensor(token_ids, dtype=torch.long).flatten()[:max_tokens]
    routing = route_tokens(model, ids_T, max_tokens=len(ids_T))
    tokens = (
        [tokenizer.decode([int(t)]) for t in ids_T] if tokenizer is not None else [str(int(t)) for t in ids_T]
    )
    tokens = [t.replace("\n", "\\n").replace("\t", "\\t") or "\u2205" for t in tokens]
    T = len(tokens)
    layer_ids = list(model.config.moe_layer_ids)
    L = len(routing)
    E = model.config.num_experts
    fig = _figure(max(6.0, 0.28 * T + 2), 0.3 * E * L + 1.2 * L + 0.8)
    axes = fig.subplots(L, 1, squeeze=False)[:, 0]
    pfig = make_subplots(rows=L, cols=1, subplot_titles=[f"layer {i}" for i in layer_ids], shared_xaxes=True)
    positions = [f"{i}:{tok}" for i, tok in enumerate(tokens)]
    probs_LET = []
    for record in routing:
        probs_TE = record.probs_TE.detach().float().cpu()
        probs_LET.append((probs_TE / probs_TE.sum(-1, keepdim=True).clamp_min(1e-30)).t().numpy())
    # one scale for every layer (equal colours are equal probabilities), shown in one colour bar
    vmax = max(max(float(p.max()) for p in probs_LET), 1e-6)
    for ax, record, probs_ET, layer_id, row in zip(axes, routing, probs_LET, layer_ids, range(1, L + 1)):
        image = ax.imshow(probs_ET, aspect="auto", cmap="Blues", vmin=0.0, vmax=vmax)
        kept_TK = ~record.dropped_TK.cpu()
        for t, k in zip(*torch.nonzero(kept_TK, as_tuple=True)):
            e = int(record.expert_ids_TK[t, k])
            ax.add_patch(_rect(int(t), e))
        ax.set(
            title=f"layer {layer_id}: router probability (outlined: kept slots)",
            ylabel="expert",
            yticks=range(E),
        )
        ax.set_xticks(range(T), tokens, rotation=90, fontsize=7, fontfamily="monospace")
        pfig.add_trace(
            go.Heatmap(
                z=probs_ET,
                x=positions,
                y=list(range(E)),
                coloraxis="coloraxis",
                hovertemplate="token %{x}, expert %{y}: p=%{z:.3f}<extra></extra>",
            ),
            row=row,
            col=1,
        )
    fig.colorbar(image, ax=list(axes), label="router probability", fraction=0.02)
    pfig.update_layout(
        title="Token-to-expert routing",
        coloraxis={
            "colorscale": "Blues",
            "cmin": 0.0,
            "cmax": vmax,
            "colorbar": {"title": {"text": "router probability"}},
        },
        height=260 * L + 120,
    )
    return _finish("token_routing", fig, pfig, out_dir)


def _rect(t: int, e: int):
    return Rectangle((t - 0.5, e - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.0)


def render_all(
    profile: RouterProfile, out_dir: str | Path | None = None, model=None, token_ids=None, tokenizer=None
) -> dict[str, Plot]:
    """Every picture of ``profile`` (written into ``out_dir`` when given); the token heatmap too when a model is given, over
    ``token_ids`` or else the first project prompt encoded with ``tokenizer``."""
    out = {
        "expert_load": plot_expert_load(profile, out_dir),
        "coactivation": plot_coactivation(profile, out_dir),
        "specialization": plot_specialization(profile, out_dir),
    }
    if profile.flows:
        out["routing_flow"] = plot_routing_flow(profile, out_dir)
    if token_ids is None and tokenizer is not None:
        token_ids = tokenizer.encode(PROMPTS[0].text, add_special_tokens=False)
    if model is not None and token_ids is not None:
        out["token_routing"] = plot_token_routing(model, token_ids, out_dir, tokenizer)
    return out
