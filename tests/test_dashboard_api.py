"""The dashboard's server over real run directories: history, downsampling, routing, alerts, live events,
tokens, path traversal, and that no text from an event file is ever served."""

import json
import os
import shutil
import threading
import urllib.parse
import urllib.request

import numpy as np
import pytest
from fastapi.testclient import TestClient

from dashboard.cli import DashboardError, resolve_token
from dashboard.runs import downsample_series
from dashboard.server import create_app
from moe_core.train import read_jsonl
from moe_core.train.load_log import SIDECAR, SIDECAR_HEADER, read_sidecar
from tests.dashboard_helpers import (
    DEAD_EXPERT,
    DEAD_LAYER,
    lifecycle_layout,
    serve,
    train_run,
    write_analysis,
)

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 12


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    """Two real tiny runs: aux-free routing with an injected dead expert, and top-k routing."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("runs")
    train_run(root / "auxfree-dead", STEPS, "aux_free", dead=True)
    train_run(root / "group" / "topk", STEPS, "topk")
    torch.set_num_threads(threads)
    return root


@pytest.fixture(scope="module")
def client(runs_root):
    return TestClient(create_app([runs_root]))


def run_ids(client):
    return {r["name"]: r["id"] for r in client.get("/api/runs").json()["runs"]}


def test_trainer_writes_alerts_biases_and_the_load_log(runs_root):
    rows = read_jsonl(runs_root / "auxfree-dead" / "metrics.jsonl")
    key = f"alert/dead_expert/layer_{DEAD_LAYER}/expert_{DEAD_EXPERT}"
    raised = [r["step"] for r in rows if key in r]
    assert (
        raised and raised[0] == 2 and raised == list(range(2, STEPS + 1))
    )  # after dead_steps=2 logged steps
    assert all(f"moe/layer_0/expert_{e}_bias" in rows[-1] for e in range(8))
    assert not any(
        k.startswith("alert/dead_expert")
        for r in read_jsonl(runs_root / "group/topk/metrics.jsonl")
        for k in r
    )
    header, loads = read_sidecar(runs_root / "auxfree-dead")
    assert loads.shape == (STEPS, header["row_floats"])
    assert loads[:, 0].tolist() == list(range(1, STEPS + 1))
    width, E = header["per_layer_floats"], header["experts"]
    for i in range(len(header["layers"])):
        shares = loads[:, 2 + i * width : 2 + i * width + E]
        np.testing.assert_allclose(shares.sum(1), 1.0, rtol=1e-5)  # shares of routed slots
    assert np.all(loads[:, 2 + DEAD_EXPERT] == 0)
    # the same numbers as the event file
    np.testing.assert_allclose(loads[:, 2 + 1], [r["moe/layer_0/expert_1_frac"] for r in rows], rtol=1e-6)


def test_runs_listing_summary_config_checkpoints(client):
    ids = run_ids(client)
    assert set(ids) == {"auxfree-dead", "group/topk"}
    s = client.get(f"/api/runs/{ids['auxfree-dead']}").json()
    assert s["kind"] == "train" and s["layers"] == [0, 1] and s["experts"] == 8 and s["has_bias"]
    assert s["last_step"] == STEPS and s["routing_rows"] == STEPS
    assert {"loss", "lm_loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "val_loss"} <= set(s["metrics"])
    assert [a["key"] for a in s["alerts"] if "dead" in a["key"]] == [
        f"alert/dead_expert/layer_0/expert_{DEAD_EXPERT}"
    ]
    assert client.get(f"/api/runs/{ids['auxfree-dead']}/config").json()["config"]["steps"] == STEPS
    assert [
        c["step"] for c in client.get(f"/api/runs/{ids['auxfree-dead']}/checkpoints").json()["checkpoints"]
    ] == [STEPS]


def test_scalars_full_and_downsampled(client, runs_root):
    rid = run_ids(client)["auxfree-dead"]
    rows = read_jsonl(runs_root / "auxfree-dead" / "metrics.jsonl")
    full = client.get(f"/api/runs/{rid}/scalars?keys=loss,val_loss,nope").json()["series"]
    assert set(full) == {"loss", "val_loss"}
    assert full["loss"]["x"] == list(range(1, STEPS + 1))
    assert full["loss"]["y"] == pytest.approx([r["loss"] for r in rows])
    assert full["val_loss"]["x"] == [5, 10, 12]
    small = client.get(f"/api/runs/{rid}/scalars?keys=loss&points=4").json()["series"]["loss"]
    assert len(small["y"]) == 4
    for lo, mean, hi in zip(small["min"], small["y"], small["max"]):
        assert lo <= mean <= hi
    assert max(small["max"]) == pytest.approx(max(r["loss"] for r in rows))  # spikes survive downsampling
    by_tokens = client.get(f"/api/runs/{rid}/scalars?keys=loss&x=tokens").json()["series"]["loss"]
    assert by_tokens["x"] == [r["tokens"] for r in rows]
    ranged = client.get(f"/api/runs/{rid}/scalars?keys=loss&start=3&end=6").json()["series"]["loss"]
    assert ranged["x"] == [3, 4, 5, 6]


def test_downsample_series_keeps_extremes_and_nan():
    steps = np.arange(1000, dtype=float)
    values = np.sin(steps / 50)
    values[500] = 40.0
    values[10] = np.nan
    out = downsample_series(steps, values, 100)
    assert len(out["x"]) == 100 and max(out["max"]) == 40.0 and None not in out["y"]


def test_routing_layer_and_now(client):
    ids = run_ids(client)
    r = client.get(f"/api/runs/{ids['auxfree-dead']}/routing?layer=0").json()
    assert r["experts"] == 8 and r["steps"] == list(range(1, STEPS + 1)) and len(r["frac"]) == STEPS
    assert all(abs(sum(row) - 1) < 1e-5 and row[DEAD_EXPERT] == 0 for row in r["frac"])
    assert len(r["bias"]) == STEPS and r["bias"][-1][DEAD_EXPERT] < -1000
    assert len(r["drop_rate"]) == len(r["entropy"]) == len(r["max_over_mean_load"]) == STEPS
    down = client.get(f"/api/runs/{ids['auxfree-dead']}/routing?layer=1&points=3").json()
    assert len(down["frac"]) == 3 and all(abs(sum(row) - 1) < 1e-5 for row in down["frac"])
    topk = client.get(f"/api/runs/{ids['group/topk']}/routing?layer=1").json()
    assert "bias" not in topk
    assert client.get(f"/api/runs/{ids['group/topk']}/routing?layer=7").status_code == 404
    now = client.get(f"/api/runs/{ids['auxfree-dead']}/routing/now").json()
    assert now["step"] == STEPS and len(now["frac"]) == 2 and now["frac"][0] == r["frac"][-1]


def _copy_partial(src, dst, rows: int):
    """A run directory holding the first ``rows`` logged steps of ``src`` (as a trainer would have by then)."""
    dst.mkdir()
    lines = (src / "metrics.jsonl").read_text().splitlines(keepends=True)
    (dst / "metrics.jsonl").write_text("".join(lines[:rows]))
    shutil.copy(src / SIDECAR_HEADER, dst / SIDECAR_HEADER)
    width = 4 * json.loads((src / SIDECAR_HEADER).read_text())["row_floats"]
    data = (src / SIDECAR).read_bytes()
    (dst / SIDECAR).write_bytes(data[: rows * width])
    return lines, data, width


def test_stream_sends_each_new_row_to_every_client_once(runs_root, tmp_path):
    """Server-sent events over a real server, two clients on one run (the Run and Routing pages): rows
    appended after connecting arrive at both, in order, once; a torn (half-written) line waits until it is
    complete."""
    root = tmp_path / "live"
    root.mkdir()
    lines, data, width = _copy_partial(runs_root / "auxfree-dead", root / "run", 4)
    with serve(create_app([root], poll_seconds=0.05)) as url:
        rid = json.load(urllib.request.urlopen(url + "/api/runs"))["runs"][0]["id"]
        clients = [([], threading.Event(), threading.Event()) for _ in range(2)]

        def listen(received, connected, done):
            with urllib.request.urlopen(f"{url}/api/runs/{rid}/stream?since=4", timeout=20) as resp:
                for raw in resp:
                    connected.set()
                    line = raw.decode()
                    if line.startswith("data: "):
                        received.append(json.loads(line[6:]))
                        if max([r["step"] for u in received for r in u["rows"]], default=0) >= 8:
                            done.set()
                            return

        for client in clients:
            threading.Thread(target=listen, args=client, daemon=True).start()
        assert all(c[1].wait(20) for c in clients)
        with open(root / "run" / "metrics.jsonl", "a") as f, open(root / "run" / SIDECAR, "ab") as g:
            for i in range(4, 8):
                f.write(lines[i][:20])  # torn: the rest of the line comes later
                f.flush()
                threading.Event().wait(0.15)
                f.write(lines[i][20:])
                f.flush()
                g.write(data[i * width : (i + 1) * width])
                g.flush()
        assert all(c[2].wait(20) for c in clients), [c[0] for c in clients]
    for received, _, _ in clients:
        assert [r["step"] for u in received for r in u["rows"]] == [5, 6, 7, 8]
        assert [r["step"] for u in received for r in u["routing"]][:3] == [5, 6, 7]
        assert all(len(r["frac"]) == 2 and len(r["frac"][0]) == 8 for u in received for r in u["routing"])
        assert any(a["key"].startswith("alert/dead_expert") for a in received[-1]["alerts"])


def test_token_required_beyond_localhost(runs_root):
    with pytest.raises(DashboardError, match="token"):
        resolve_token("0.0.0.0", None)
    assert resolve_token("127.0.0.1", None) is None
    c = TestClient(create_app([runs_root], token="s3cret"))
    for path in ("/api/runs", "/", "/assets/app.js"):
        assert c.get(path).status_code == 401
    assert c.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    page = c.get("/?token=s3cret")
    assert page.status_code == 200 and "moe_lab_token" in page.headers.get("set-cookie", "")
    assert c.get("/api/runs").status_code == 200  # the cookie set by the page carries on


@pytest.mark.parametrize(
    "path",
    [
        "/api/runs/..%2F..%2F..%2Fetc%2Fpasswd",
        "/api/runs/%2Fetc%2Fpasswd/config",
        "/api/runs/../../etc/passwd",
        "/api/runs/%2e%2e%2f%2e%2e/scalars",
        "/assets/..%2F..%2Fserver.py",
        "/assets/%2e%2e%2fruns.py",
        "/assets/../../../etc/passwd",
        "/assets/%252e%252e%252fserver.py",
        "/api/runs//etc/passwd",
    ],
)
def test_no_path_outside_the_roots_is_served(client, path):
    resp = client.get(path)
    assert resp.status_code in (401, 404, 405), (path, resp.status_code)
    assert "root:" not in resp.text and "create_app" not in resp.text


def test_symlinks_out_of_the_root_are_not_followed(runs_root, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(runs_root / "group" / "topk", outside / "secret-run")
    root = tmp_path / "root"
    (root / "mine").mkdir(parents=True)
    os.symlink(outside / "secret-run", root / "linked-run")  # a directory symlink out of the root
    os.symlink(outside / "secret-run" / "metrics.jsonl", root / "mine" / "metrics.jsonl")  # a file symlink
    c = TestClient(create_app([root]))
    assert c.get("/api/runs").json()["runs"] == []
    encoded = urllib.parse.quote(str(outside / "secret-run"), safe="")
    assert c.get(f"/api/runs/{encoded}").status_code == 404


def test_text_in_an_event_file_is_never_served(tmp_path):
    run = tmp_path / "root" / "r"
    run.mkdir(parents=True)
    rows = [
        {"step": 1, "time": 1.0, "loss": 2.0, "prompt": "SECRET PROMPT", "moe/layer_0/note": "SECRET"},
        {"step": 2, "time": 2.0, "loss": 1.5, "sample_text": "SECRET TEXT"},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = TestClient(create_app([tmp_path / "root"]))
    rid = c.get("/api/runs").json()["runs"][0]["id"]
    for path in (f"/api/runs/{rid}", f"/api/runs/{rid}/scalars?keys=loss,prompt,sample_text"):
        resp = c.get(path)
        assert resp.status_code == 200 and "SECRET" not in resp.text
    assert c.get(f"/api/runs/{rid}/scalars?keys=loss").json()["series"]["loss"]["y"] == [2.0, 1.5]


def test_specialization_and_cost_from_the_runs_saved_analysis(client, runs_root):
    """A real router profile and cost report beside a run (where `moe-lab analyze` writes them); served as
    numbers, never the profile's vocabulary strings."""
    run_dir = runs_root / "group" / "topk"
    profile, report = write_analysis(run_dir)

    rid = run_ids(client)["group/topk"]
    spec = client.get(f"/api/runs/{rid}/specialization").json()["profile"]
    assert [x["layer"] for x in spec["layers"]] == [0, 1]
    layer = spec["layers"][0]
    assert sum(layer["share"]) == pytest.approx(1.0)
    assert layer["share"] == pytest.approx(profile.layers[0].share_E.tolist())
    assert layer["mi_class_bits"] == pytest.approx(profile.layers[0].mi_class_bits)
    assert len(spec["classes"]) > 1 and len(layer["class_share"]) == 8
    assert all(
        len(row) == len(spec["classes"]) and sum(row) == pytest.approx(1.0)
        for row in layer["class_share"]
        if row[0] is not None
    )
    used = [e for e in range(8) if profile.layers[0].kept_E[e] > 0]
    assert all(layer["coactivation"][e][e] == 1.0 for e in used)  # P(e used | e used)
    assert spec["flows"][0]["from_layer"] == 0 and len(spec["flows"][0]["top1"]) == 8
    top_token = profile.layers[0].top_tokens[used[0]][0].token
    resp = client.get(f"/api/runs/{rid}/specialization")
    assert "top_tokens" not in resp.text and (not top_token or f'"{top_token}"' not in resp.text)

    cost = client.get(f"/api/runs/{rid}/cost").json()
    assert cost["report"]["device"] == "cpu"
    assert cost["report"]["usd_per_million_tokens"] == pytest.approx(report.usd_per_million_tokens)
    assert cost["report"]["flop_saving"] == pytest.approx(report.flop_saving)
    assert cost["training"]["flops_per_token"] > 0
    other = run_ids(client)["auxfree-dead"]
    assert client.get(f"/api/runs/{other}/specialization").json()["profile"] is None


def test_token_to_expert_view_of_the_prompt_set(runs_root, tmp_path):
    """The run's model routing the project's prompt set, computed once per model on the server's worker: a
    clear error without a model or without a tokenizer, then per prompt, token and layer the experts a plain
    forward pass of the same checkpoint chooses."""
    from moe_core import load
    from moe_core.analytics.token_routing import route_tokens
    from moe_core.eval.prompts import PROMPTS
    from moe_core.train.checkpoint import latest_checkpoint
    from tests.test_inference_generate import _char_tokenizer

    root = tmp_path / "runs"
    shutil.copytree(runs_root / "group" / "topk", root / "topk")
    (root / "empty").mkdir()
    (root / "empty" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    client = TestClient(create_app([root]))
    ids = run_ids(client)
    missing = client.get(f"/api/runs/{ids['empty']}/prompt-routing")
    assert missing.status_code == 404 and "no exported model" in missing.json()["detail"]
    no_tok = client.get(f"/api/runs/{ids['topk']}/prompt-routing")  # synthetic data: no tokenizer
    assert no_tok.status_code == 409 and "names no tokenizer" in no_tok.json()["detail"]

    ckpt = latest_checkpoint(root / "topk" / "checkpoints")
    tokenizer = _char_tokenizer(128)
    tokenizer.save_pretrained(ckpt)  # a new file under the model: a new cache key, computed again
    resp = client.get(f"/api/runs/{ids['topk']}/prompt-routing?wait=60")
    assert resp.status_code == 200, resp.text
    view = resp.json()
    loaded = load(ckpt)
    E, K = loaded.config.num_experts, loaded.config.num_experts_per_tok
    assert (view["experts"], view["top_k"], view["layers"]) == (E, K, [0, 1])
    assert [p["name"] for p in view["prompts"]] == [p.name for p in PROMPTS]
    for prompt, shown in zip(PROMPTS, view["prompts"]):
        ids_T = tokenizer.encode(prompt.text, add_special_tokens=False)
        assert shown["tokens"] == [tokenizer.decode([t]) for t in ids_T]  # the prompt set's own tokens only
        records = route_tokens(loaded.model, ids_T)
        for layer, record in zip(shown["layers"], records):
            assert layer["experts"] == record.expert_ids_TK.tolist()
            assert all(len(row) == K and 0 <= min(row) and max(row) < E for row in layer["experts"])
            np.testing.assert_allclose(layer["weights"], record.weights_TK, atol=1e-4)
    again = client.get(f"/api/runs/{ids['topk']}/prompt-routing?wait=0")  # cached: no wait needed
    assert again.status_code == 200 and again.json() == view


def test_a_resumed_run_keeps_one_row_per_step(tmp_path):
    """On resume the trainer logs the steps after its checkpoint again: the load log drops its rows past the
    checkpoint (and a torn last row), the server keeps the last event-file row of each step."""
    from moe_core.train.alerts import AlertThresholds, RoutingMonitor

    run = tmp_path / "root" / "r"
    run.mkdir(parents=True)
    monitor = RoutingMonitor(run, [0], 4, AlertThresholds())
    for step in range(1, 7):
        monitor.observe(
            step, {"tokens": step * 10.0, **{f"moe/layer_0/expert_{e}_frac": 0.25 for e in range(4)}}
        )
    monitor.close()
    with open(run / SIDECAR, "ab") as f:
        f.write(b"\0" * 7)  # torn
    RoutingMonitor(run, [0], 4, AlertThresholds(), start_step=3).close()
    assert read_sidecar(run)[1][:, 0].tolist() == [1, 2, 3]
    assert (run / SIDECAR).stat().st_size % (4 * read_sidecar(run)[0]["row_floats"]) == 0

    rows = [(1, 5.0), (2, 4.0), (3, 3.0), (2, 4.5), (3, 3.5), (4, 2.5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in rows))
    c = TestClient(create_app([tmp_path / "root"]))
    rid = c.get("/api/runs").json()["runs"][0]["id"]
    loss = c.get(f"/api/runs/{rid}/scalars?keys=loss").json()["series"]["loss"]
    assert loss["x"] == [1, 2, 3, 4] and loss["y"] == [5.0, 4.5, 3.5, 2.5]


@pytest.mark.slow  # MLflow creates its SQLite schema: ~10 s
def test_mlflow_runs_are_listed_and_their_metric_history_served(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MOE_LAB_EXPERIMENT", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c = MlflowClient(tracking_uri=uri)
    run = c.create_run(c.create_experiment("moe-lab"), run_name="pretrain")
    rid = run.info.run_id
    for step in range(1, 6):
        c.log_metric(rid, "loss", 5.0 - step, step=step)
    c.log_metric(rid, "loss", 0.5, step=5)  # logged again at a step (a resumed run): the last one counts
    c.log_metric(rid, "val_loss", 2.5)
    local = tmp_path / "runs" / "a"  # a run directory that logged to another MLflow run
    local.mkdir(parents=True)
    (local / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    other = c.create_run(c.get_experiment_by_name("moe-lab").experiment_id, run_name="local").info.run_id
    (local / "mlflow_run.json").write_text(json.dumps({"run_id": other}))
    client = TestClient(create_app([tmp_path / "runs"], mlflow_uri=uri))
    listed = {r["name"]: r for r in client.get("/api/runs").json()["mlflow"]}
    assert listed["pretrain"]["metrics"]["val_loss"] == 2.5 and listed["pretrain"]["local"] is None
    assert listed["local"]["local"] == client.get("/api/runs").json()["runs"][0]["id"]
    # a run known only to MLflow: its metric history, by step
    assert set(client.get(f"/api/mlflow/{rid}").json()["metrics"]) == {"loss", "val_loss"}
    loss = client.get(f"/api/mlflow/{rid}/scalars?keys=loss,missing").json()["series"]
    assert list(loss) == ["loss"] and loss["loss"]["x"] == [1, 2, 3, 4, 5]
    assert loss["loss"]["y"] == [4.0, 3.0, 2.0, 1.0, 0.5]
    assert len(client.get(f"/api/mlflow/{rid}/scalars?keys=loss&points=2").json()["series"]["loss"]["x"]) == 2
    assert client.get("/api/mlflow/..%2F..%2Fetc/scalars").status_code == 404
    assert client.get("/api/mlflow/" + "0" * 32 + "x").status_code == 404
    no_mlflow = TestClient(create_app([tmp_path / "runs"]))
    assert no_mlflow.get(f"/api/mlflow/{rid}").status_code == 404


def test_routing_u16_encoding_matches_json(client):
    import base64

    rid = run_ids(client)["auxfree-dead"]
    plain = client.get(f"/api/runs/{rid}/routing?layer=1&points=5").json()
    packed = client.get(f"/api/runs/{rid}/routing?layer=1&points=5&encoding=u16").json()
    enc = packed["frac"]
    q = np.frombuffer(base64.b64decode(enc["data"]), dtype="<u2").reshape(enc["shape"])
    np.testing.assert_allclose(q / enc["scale"], plain["frac"], atol=1 / enc["scale"])
    assert packed["steps"] == plain["steps"]
    assert client.get(f"/api/runs/{rid}/routing?layer=1&encoding=bogus").status_code == 422


@pytest.mark.slow  # a real two-process expert-parallel run (gloo), shared with test_train_parallel.py
def test_distributed_run_is_shown_per_rank(ep2_run):
    steps = list(range(1, 21))
    client = TestClient(create_app([ep2_run.parent]))
    rid = client.get("/api/runs").json()["runs"][0]["id"]
    assert client.get(f"/api/runs/{rid}").json()["ranks"] == 2
    ranks = client.get(f"/api/runs/{rid}/ranks").json()["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:  # each rank's own all-to-all time and bytes, at every logged step
        assert r["series"]["a2a_ms"]["x"] == steps and all(v > 0 for v in r["series"]["a2a_ms"]["y"])
        assert all(v > 0 for v in r["series"]["a2a_bytes_sent"]["y"])
        for key in ("step_time_s", "tokens_per_s", "max_memory_mb", "rank_loss"):  # the straggler view
            assert r["series"][key]["x"] == steps and all(v > 0 for v in r["series"][key]["y"]), key
    main = read_jsonl(ep2_run / "metrics.jsonl")
    own_losses = np.array([r["series"]["rank_loss"]["y"] for r in ranks])
    assert own_losses[0].tolist() != own_losses[1].tolist()  # each rank its own slice of the batch,
    logged = [row["loss"] for row in main if "loss" in row]
    np.testing.assert_allclose(own_losses.mean(0), logged, rtol=1e-6)  # and their mean is the logged loss
    own = read_jsonl(ep2_run / "metrics.rank1.jsonl")  # small: no routing, no other rank's
    assert [row["step"] for row in own] == steps
    assert not any(k.startswith(("moe/", "comm/")) or k == "loss" for k in own[0])  # no all-reduced figure


def test_a_runs_analysis_is_its_own_never_a_neighbours(runs_root, tmp_path):
    """A lifecycle's MoE run holds its analysis; the dense baseline beside it has none and shows none, even
    with an analysis folder above both (where the lifecycle wrote the MoE's before)."""
    life = tmp_path / "runs" / "lifecycle"
    shutil.copytree(
        runs_root / "group" / "topk", life / "pretrain", ignore=shutil.ignore_patterns("analysis")
    )
    shutil.copytree(
        runs_root / "group" / "topk", life / "dense-active", ignore=shutil.ignore_patterns("analysis")
    )
    _, report = write_analysis(life / "pretrain")
    shutil.copytree(life / "pretrain" / "analysis", life / "analysis")  # above both runs
    client = TestClient(create_app([tmp_path / "runs"]))
    ids = run_ids(client)
    moe, dense = ids["lifecycle/pretrain"], ids["lifecycle/dense-active"]
    assert client.get(f"/api/runs/{moe}/cost").json()["report"]["flop_saving"] == pytest.approx(
        report.flop_saving
    )
    assert [
        x["layer"] for x in client.get(f"/api/runs/{moe}/specialization").json()["profile"]["layers"]
    ] == [0, 1]
    assert client.get(f"/api/runs/{dense}/cost").json()["report"] is None
    assert client.get(f"/api/runs/{dense}/specialization").json()["profile"] is None


def test_inference_figures_come_from_inference_events_only(client, tmp_path):
    """A training run's tokens/s are training figures: the Inference page's endpoint serves none for it and
    says why; an inference run's own events are served."""
    rid = run_ids(client)["auxfree-dead"]
    assert "tokens_per_s" in client.get(f"/api/runs/{rid}").json()["metrics"]
    got = client.get(f"/api/runs/{rid}/inference").json()
    assert got["kind"] == "train" and got["series"] == {} and "no inference events" in got["message"]
    serving = tmp_path / "runs" / "serving"
    serving.mkdir(parents=True)
    rows = [{"step": s, "tokens": 2.0 * s, "tokens_per_s": 10.0 * s, "cache_hit_rate": 0.5} for s in (1, 2)]
    (serving / "inference.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    other = TestClient(create_app([tmp_path / "runs"]))
    got = other.get(f"/api/runs/{run_ids(other)['serving']}/inference").json()
    assert got["kind"] == "inference" and got["message"] is None
    assert got["series"]["tokens_per_s"]["y"] == [10.0, 20.0] and got["series"]["cache_hit_rate"]["x"] == [
        1,
        2,
    ]


def test_a_dense_baseline_is_marked_in_the_listing(runs_root, tmp_path):
    """The app opens on the newest run that is not a dense baseline: the listing says which runs are."""
    lifecycle_layout(runs_root / "group" / "topk", tmp_path / "runs" / "lifecycle")
    client = TestClient(create_app([tmp_path / "runs"]))
    listed = client.get("/api/runs").json()["runs"]
    assert [(r["name"], r["baseline"]) for r in listed] == [
        ("lifecycle/dense-active", "active"),  # the newest event file
        ("lifecycle/pretrain", None),
    ]


def test_a_run_that_finished_is_not_live_however_recent(tmp_path):
    """The README's `moe-lab train ... --dashboard` run, opened seconds after it finished, was listed as live
    (its event file had changed within LIVE_SECONDS): a training run's final/ and a fine-tune's summary.json
    are written after the last event, so a run holding one newer than its events has ended; one resumed later
    writes events after them and is live again."""
    root = tmp_path / "runs"
    for name in ("training", "trained", "finetuned", "resumed"):
        (root / name).mkdir(parents=True)
        (root / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    (root / "trained" / "final").mkdir()
    (root / "finetuned" / "summary.json").write_text("{}")
    (root / "resumed" / "final").mkdir()
    earlier = os.stat(root / "resumed" / "final").st_mtime - 5
    os.utime(root / "resumed" / "final", (earlier, earlier))
    with TestClient(create_app([root])) as client:
        live = {r["name"]: r["live"] for r in client.get("/api/runs").json()["runs"]}
    assert live == {"training": True, "trained": False, "finetuned": False, "resumed": True}
