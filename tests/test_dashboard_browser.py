"""The dashboard in a real browser: headless Chromium (Debian's /usr/bin/chromium, driven by Playwright for
Python) watching a real training run. The routing heatmap and the loss chart gain points while the run
advances, the injected dead expert raises the alert on the page, the compare page overlays two runs, and the
Inference page shows what `moe-lab generate --events` wrote. Every heatmap has a colour bar saying what a
colour means, and heatmaps shown for comparison (one run's layers) share one colour domain.
Screenshots go to the test's temporary directory (or $MOE_LAB_SCREENSHOTS)."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from playwright.sync_api import sync_playwright

from dashboard.server import create_app
from moe_core import MoEForCausalLM, get_config
from moe_core.analytics.profile import TOKEN_CLASSES, collect_profile
from moe_core.cli import main
from moe_core.eval.prompts import PROMPTS
from moe_core.train import read_jsonl
from moe_core.train.checkpoint import latest_checkpoint
from tests.dashboard_helpers import DEAD_EXPERT, lifecycle_layout, serve, train_run, write_analysis
from tests.test_inference_generate import _char_tokenizer, tiny

CHROMIUM = os.environ.get(
    "MOE_LAB_CHROMIUM", "/usr/bin/chromium"
)  # Debian's; .ci/run installs it when missing
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

LIVE_RUN = """
import sys, torch
torch.set_num_threads(1)
from pathlib import Path
from tests.dashboard_helpers import train_run
train_run(Path(sys.argv[1]), int(sys.argv[2]), "aux_free", dead=True)
"""


def wait_for_run(url: str, name: str, timeout: float = 120, routing: bool = True) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = json.load(urllib.request.urlopen(url + "/api/runs"))["runs"]
        for r in runs:
            if r["name"] == name:
                summary = json.load(urllib.request.urlopen(f"{url}/api/runs/{r['id']}"))
                if summary["routing_rows"] >= 1 or not routing:
                    return r["id"]
        time.sleep(0.3)
    raise AssertionError(f"run {name} did not log a step within {timeout} s")


def generate_events(model_dir: Path, events: Path) -> list[dict]:
    """A tiny model generating with an expert cache, its figures written as the dashboard's inference run."""
    tiny().save_pretrained(model_dir)
    _char_tokenizer(128).save_pretrained(model_dir)
    args = ["generate", str(model_dir), "--prompt", "abc", "--prompt", "de", "--max-new-tokens", "6"]
    args += ["--batch-size", "2", "--expert-cache", "3", "--events", str(events), "--no-stream"]
    assert main(args) == 0
    return read_jsonl(events / "inference.jsonl")


def attr(page, selector: str, name: str) -> int:
    return int(page.get_attribute(selector, name) or 0)


def grows(page, selector: str, name: str, by: int = 3, timeout_ms: int = 30000) -> tuple[int, int]:
    """Wait until the element's counter attribute rises by ``by`` over its current value."""
    page.wait_for_selector(f"{selector}[{name}]", timeout=timeout_ms)
    page.wait_for_function(
        f"document.querySelector('{selector}') && "
        f"+document.querySelector('{selector}').getAttribute('{name}') > 0",
        timeout=timeout_ms,
    )
    before = attr(page, selector, name)
    page.wait_for_function(
        f"+document.querySelector('{selector}').getAttribute('{name}') >= {before + by}", timeout=timeout_ms
    )
    return before, attr(page, selector, name)


def colour_bars(page, selector: str) -> list[dict]:
    """The colour bar of each heatmap matching ``selector``, read in one go (a live page may redraw between
    two reads): its domain, whether it is shared, its label, its drawn tick labels and its caption."""
    return page.eval_on_selector_all(
        selector,
        """hs => hs.map(h => {
             const c = h.querySelector('[data-testid=colorbar]');
             return c && { title: h.dataset.title, lo: +c.dataset.lo, hi: +c.dataset.hi, scale: c.dataset.scale,
                           label: c.dataset.label, ticks: [...c.querySelectorAll('[data-tick]')].map(t => t.textContent),
                           text: c.innerText };
           })""",
    )


def assert_one_scale(bars: list[dict], label: str, diverging: bool = False) -> None:
    """Each bar is drawn, labelled with ``label``, says its scale is shared, and all have one domain whose
    ends are the drawn ticks."""
    assert bars and all(bars), bars  # every heatmap has a colour bar
    for b in bars:
        assert label in b["label"] and label in b["text"], b
        assert b["scale"] == "shared" and "one scale for" in b["text"], b
        assert [float(t) for t in b["ticks"]] == pytest.approx([b["lo"], b["hi"]], rel=1e-2), b
    assert len({(b["lo"], b["hi"]) for b in bars}) == 1, bars  # one domain: equal colours, equal values
    lo, hi = bars[0]["lo"], bars[0]["hi"]
    assert (lo == -hi < 0) if diverging else (lo == 0 < hi), bars


def test_live_run_in_the_browser(tmp_path):
    assert os.access(CHROMIUM, os.X_OK), f"{CHROMIUM} is missing: apt-get install chromium (.ci/run does)"
    shots = Path(os.environ.get("MOE_LAB_SCREENSHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    root = tmp_path / "runs"
    baseline = train_run(root / "baseline-topk", 10, "topk")  # a finished run to compare against
    write_analysis(baseline.out_dir)
    # the run's data is synthetic: a tokenizer beside its model, so it can encode the prompt set
    tokenizer = _char_tokenizer(128)
    tokenizer.save_pretrained(latest_checkpoint(baseline.out_dir / "checkpoints"))
    serving = generate_events(tmp_path / "model", root / "serving")  # an inference run: moe-lab generate
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    log = (tmp_path / "live-run.log").open("w")  # a file, not a pipe: a full pipe would stall the run
    live = subprocess.Popen(
        [sys.executable, "-c", LIVE_RUN, str(root / "live-auxfree"), "3000"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with serve(create_app([root], poll_seconds=0.1)) as url, sync_playwright() as p:
            live_id = wait_for_run(url, "live-auxfree")
            base_id = wait_for_run(url, "baseline-topk")
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))

            # Routing, live: the heatmap of layer 0 gains columns while the run advances
            page.goto(f"{url}/#/routing/{live_id}")
            heat = '.heatmap[data-title^="layer 0: expert load"]'
            before, after = grows(page, heat, "data-columns")
            assert after >= before + 3
            page.wait_for_selector(
                f'[data-alert="alert/dead_expert/layer_0/expert_{DEAD_EXPERT}"]', timeout=30000
            )
            assert "dead expert" in page.inner_text("[data-testid=alerts]")
            page.wait_for_selector('.heatmap[data-title^="layer 0: aux-free bias"]')
            # ... every layer's load map and the "now" map on one colour scale, the bias maps on another
            loads = colour_bars(page, '.heatmap[data-title*="expert load"], .heatmap[data-title^="now:"]')
            assert len(loads) == 3  # mixtral-tiny: 2 MoE layers, and the "now" map
            assert_one_scale(loads, "share of the layer's routed slots (uniform = 1/8")
            assert loads[0]["hi"] <= 1
            biases = colour_bars(page, '.heatmap[data-title*="aux-free bias"]')
            assert len(biases) == 2
            assert_one_scale(biases, "aux-free bias", diverging=True)
            page.screenshot(path=str(shots / "routing.png"), full_page=True)

            # Run: the loss chart gains points
            page.goto(f"{url}/#/run/{live_id}")
            before, after = grows(page, '.chart[data-title="loss"]', "data-points")
            assert after >= before + 3
            page.screenshot(path=str(shots / "run.png"), full_page=True)

            # Compare: the live run and the finished baseline overlaid on one chart
            page.goto(f"{url}/#/compare/{live_id},{base_id}")
            chart = '.chart[data-title="loss"]'
            page.wait_for_function(
                f"+document.querySelector('{chart}')?.getAttribute('data-points') > 10", timeout=30000
            )
            legend = page.locator(f"{chart} .u-legend .u-series").all_inner_texts()
            assert any("live-auxfree" in t for t in legend) and any("baseline-topk" in t for t in legend), (
                legend
            )
            page.screenshot(path=str(shots / "compare.png"), full_page=True)

            # Specialization and Cost of the finished run, from its saved profile and cost report
            page.goto(f"{url}/#/specialization/{base_id}")
            page.wait_for_selector("[data-testid=mi-table]")
            classes = page.locator('.heatmap[data-title*="token class"]')
            assert classes.count() == 2  # one per MoE layer
            assert int(classes.first.get_attribute("data-columns")) > 1  # a column per token class
            # ... each kind of map on one colour scale over the layers: the largest value of any layer's map
            profile = json.load(urllib.request.urlopen(f"{url}/api/runs/{base_id}/specialization"))["profile"]
            for kind, key, label in [
                ("token class", "class_share", "share of the expert's routed slots in this token class"),
                ("co-activation", "coactivation", "P(column expert used | row expert used)"),
            ]:
                bars = colour_bars(page, f'.heatmap[data-title*="{kind}"]')
                assert len(bars) == 2, kind
                assert_one_scale(bars, label)
                # co-activation's diagonal is 1 by definition: blank, so the scale shows the pairs
                own_max = [
                    max(
                        v
                        for i, row in enumerate(L[key])
                        for j, v in enumerate(row)
                        if v is not None and (i != j)
                    )
                    for L in profile["layers"]
                ]
                assert bars[0]["hi"] == pytest.approx(max(own_max)), (kind, own_max)
            # ... and the token-to-expert view of the project's prompt set: tokens x MoE layers, top-k on hover
            table = "[data-testid=prompt-routing] table.tokens"
            page.wait_for_selector(table, timeout=60000)
            n_tokens = len(tokenizer.encode(PROMPTS[0].text, add_special_tokens=False))
            assert (attr(page, table, "data-tokens"), attr(page, table, "data-layers")) == (n_tokens, 2)
            cells = page.locator(f"{table} td.cell")
            assert cells.count() == 2 * n_tokens
            assert all(0 <= int(e) < 8 for e in cells.evaluate_all("cs => cs.map(c => c.dataset.expert)"))
            tip = cells.first.get_attribute("title")
            assert tip.count("expert ") == 2 and "weight" in tip  # mixtral-tiny: top-2
            page.select_option("[data-testid=prompt-select]", index=len(PROMPTS) - 1)
            last = len(tokenizer.encode(PROMPTS[-1].text, add_special_tokens=False))
            page.wait_for_selector(f'{table}[data-tokens="{last}"]')
            page.screenshot(path=str(shots / "specialization.png"), full_page=True)
            page.goto(f"{url}/#/cost/{base_id}")
            page.wait_for_selector("[data-testid=saving]")
            assert page.inner_text("[data-testid=saving]").endswith("%")

            # Inference: the figures `moe-lab generate --events --expert-cache` wrote
            page.goto(f"{url}/#/inference/{wait_for_run(url, 'serving', routing=False)}")
            hits = '.chart[data-title="expert cache hit rate"]'
            page.wait_for_function(
                f"+document.querySelector('{hits}')?.getAttribute('data-points') >= {len(serving)}",
                timeout=30000,
            )
            resident = page.inner_text("[data-testid=experts-resident]")
            assert resident == str(int(serving[-1]["experts_resident"])) == "3"
            page.screenshot(path=str(shots / "inference.png"), full_page=True)
            # ... and for a training run, no training figures drawn as inference ones: it says it has none
            page.goto(f"{url}/#/inference/{base_id}")
            page.wait_for_selector("[data-testid=no-inference]")
            assert "training run" in page.inner_text("[data-testid=no-inference]")
            assert page.locator(".chart").count() == 0
            assert not errors, errors
            browser.close()
        assert live.poll() is None, (
            f"the training run ended early: {(tmp_path / 'live-run.log').read_text()[-2000:]}"
        )
    finally:
        if live.poll() is None:
            live.send_signal(signal.SIGTERM)  # the trainer checkpoints and stops
            try:
                live.wait(timeout=60)
            except subprocess.TimeoutExpired:
                live.kill()
        log.close()
    print(f"screenshots: {shots}")


def test_the_app_opens_on_the_trained_run_with_its_baseline_one_click_away(tmp_path):
    """After a lifecycle the dense baseline's event file is the newest: the app still opens on the MoE the
    user trained, and its Compare tab overlays the MoE and its baseline."""
    train_run(tmp_path / "trained", 4, "topk")
    lifecycle_layout(tmp_path / "trained", tmp_path / "runs" / "lifecycle")
    with serve(create_app([tmp_path / "runs"])) as url, sync_playwright() as p:
        ids = {r["name"]: r["id"] for r in json.load(urllib.request.urlopen(url + "/api/runs"))["runs"]}
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(url + "/")
        page.wait_for_selector("a.run.selected")
        assert page.get_attribute("a.run.selected", "data-run") == "lifecycle/pretrain"
        compare = page.get_attribute("[data-tab=compare]", "href")
        assert compare == f"#/compare/{ids['lifecycle/pretrain']},{ids['lifecycle/dense-active']}"
        assert "dense baseline" in page.inner_text("a.run[data-run='lifecycle/dense-active']")
        browser.close()


def test_a_top1_run_says_its_coactivation_is_the_diagonal_instead_of_drawing_it(tmp_path):
    """A top-1 router sends each token to one expert: its co-activation maps would be the diagonal by
    construction, so the Specialization page says so instead of drawing them; the other maps keep their
    labelled colour bars on one scale."""
    torch.manual_seed(0)
    model = MoEForCausalLM(get_config("switch-tiny", vocab_size=64)).eval()
    run = tmp_path / "runs" / "switch"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    classes_V = torch.arange(64) % len(TOKEN_CLASSES)
    profile = collect_profile(model, [torch.randint(0, 64, (4, 16))], token_classes_V=classes_V)
    profile.to_dir(run / "analysis" / "profile")
    assert len(profile.layers) > 1
    with serve(create_app([tmp_path / "runs"])) as url, sync_playwright() as p:
        run_id = wait_for_run(url, "switch", routing=False)
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{url}/#/specialization/{run_id}")
        page.wait_for_selector("[data-testid=mi-table]")
        assert "top-1" in page.inner_text("[data-testid=coactivation-note]")
        assert page.locator('.heatmap[data-title*="co-activation"]').count() == 0
        classes = colour_bars(page, '.heatmap[data-title*="token class"]')
        assert len(classes) == len(profile.layers)
        assert_one_scale(classes, "share of the expert's routed slots in this token class")
        assert not errors, errors
        browser.close()
