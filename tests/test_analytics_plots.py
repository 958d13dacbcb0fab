"""Pictures: every plot is written as a non-empty PNG and a self-contained (offline) HTML."""

from __future__ import annotations

import pytest
import torch

from moe_core.analytics.plots import coactivation_fraction, render_all
from moe_core.analytics.profile import collect_profile
from tests.test_analytics_profile import CLASSES_V, DOMAINS, TOKENS, fixed_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    model = fixed_model()
    profile = collect_profile(
        model,
        [(TOKENS, DOMAINS)],
        token_classes_V=CLASSES_V,
        class_names=("c0", "c1"),
        domain_names=("code", "prose"),
    )
    out = tmp_path_factory.mktemp("plots")
    return profile, out, render_all(profile, out, model=model, token_ids=TOKENS[0])


def test_every_picture_is_written(rendered):
    _, out, paths = rendered
    assert set(paths) == {"expert_load", "coactivation", "routing_flow", "specialization", "token_routing"}
    for name, files in paths.items():
        png = files["png"].read_bytes()
        assert png.startswith(PNG_MAGIC), name
        assert len(png) > 5_000, name  # a drawn figure, not an empty canvas
        html = files["html"].read_text()
        assert "plotly.min.js" in html and len(html) > 1_000, name
    assert (out / "plotly.min.js").stat().st_size > 1_000_000  # written once, so the HTML opens offline
    assert (
        "Sankey" in paths["routing_flow"]["html"].read_text()
        or "sankey" in paths["routing_flow"]["html"].read_text()
    )


def test_coactivation_fraction_by_hand(rendered):
    profile, _, _ = rendered
    frac = coactivation_fraction(profile)[0]
    assert frac[0, 0] == pytest.approx(1.0)  # all 4 tokens use expert 0
    assert frac[0, 3] == pytest.approx(0.25)


def test_render_without_classes_or_flows(tmp_path):
    torch.manual_seed(0)
    from moe_core import MoEForCausalLM, get_config

    model = MoEForCausalLM(get_config("switch-tiny", num_hidden_layers=1))
    profile = collect_profile(model, [torch.randint(0, 512, (1, 16))])
    paths = render_all(profile, tmp_path)
    assert "routing_flow" not in paths  # one MoE layer: no flow to draw
    assert paths["specialization"]["png"].read_bytes().startswith(PNG_MAGIC)


def test_a_top1_coactivation_map_is_explained_not_drawn():
    """A top-1 router's co-activation map is the diagonal by construction; the figure says so."""
    from moe_core import MoEForCausalLM, get_config
    from moe_core.analytics.plots import plot_coactivation

    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("switch-tiny", vocab_size=64)).eval()
    profile = collect_profile(model, [torch.randint(0, 64, (2, 16))])
    plot = plot_coactivation(profile)
    assert "no two experts share a token" in plot.interactive.layout.title.text
    assert plot.png_bytes().startswith(PNG_MAGIC)


def test_token_routing_uses_one_scale_with_a_colour_bar():
    """Each layer was scaled to its own maximum, with no colour bar: equal colours meant different values."""
    from moe_core.analytics.plots import plot_token_routing

    model = fixed_model()
    plot = plot_token_routing(model, TOKENS[0])
    images = [image for ax in plot.figure.axes for image in ax.get_images()]
    L = len(model.config.moe_layer_ids)
    assert len(images) == L and len({image.get_clim() for image in images}) == 1
    assert len(plot.figure.axes) == L + 1  # the layers and one colour bar


# what each heatmap's colour bar must say: the value its colours stand for
HEATMAP_LABELS = {
    "expert_load": "share of the layer's kept slots",
    "coactivation": "fraction of tokens",
    "token_routing": "router probability",
}


def test_every_heatmap_has_a_labelled_colour_bar_and_one_scale_per_figure(rendered):
    """A heatmap without a colour bar does not say what a colour means, and maps compared in one figure on
    their own scales make equal colours different values: each figure's images share one clim, shown by one
    labelled colour bar, in the PNG and in the interactive HTML alike."""
    _, _, plots = rendered
    drawn = set()
    for name, plot in plots.items():
        images = [image for ax in plot.figure.axes for image in ax.get_images()]
        if not images:
            continue
        drawn.add(name)
        bars = [image.colorbar for image in images if image.colorbar is not None]
        assert len(bars) == 1, f"{name}: {len(bars)} colour bars for {len(images)} maps"
        assert bars[0].ax.get_ylabel() == HEATMAP_LABELS[name], name
        assert len({image.get_clim() for image in images}) == 1, f"{name}: maps on different scales"
        lo, hi = images[0].get_clim()
        assert lo == 0.0 and hi > 0.0 and bars[0].mappable.get_clim() == (lo, hi), name
        # the interactive version: a titled colour bar, every map on the same colour range as the PNG
        pfig = plot.interactive
        traces = [t for t in pfig.data if t.type == "heatmap"]
        assert traces, name
        if len(traces) == 1 and traces[0].coloraxis is None:
            trace = traces[0]
            assert trace.colorbar.title.text == HEATMAP_LABELS[name], name
            assert trace.zmin == 0.0, name
        else:
            assert {t.coloraxis for t in traces} == {"coloraxis"}, name
            axis = pfig.layout.coloraxis
            assert axis.colorbar.title.text == HEATMAP_LABELS[name], name
            assert (axis.cmin, axis.cmax) == pytest.approx((lo, hi)), name
    assert drawn == set(HEATMAP_LABELS)
