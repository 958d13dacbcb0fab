"""`moe-lab generate --events DIR --expert-cache N` writes live numeric figures the dashboard serves."""

import json

from fastapi.testclient import TestClient

from dashboard.server import create_app
from moe_core.cli import main
from moe_core.model import MoEForCausalLM
from moe_core.train import read_jsonl
from tests.test_inference_generate import _char_tokenizer, tiny


def test_generate_writes_inference_events_the_dashboard_serves(tmp_path, capsys):
    model: MoEForCausalLM = tiny()
    model.save_pretrained(tmp_path / "model")
    _char_tokenizer(128).save_pretrained(tmp_path / "model")
    events = tmp_path / "runs" / "serving"
    assert (
        main(
            [
                "generate",
                str(tmp_path / "model"),
                "--prompt",
                "secret prompt one",
                "--prompt",
                "a cat",
                "--max-new-tokens",
                "6",
                "--batch-size",
                "2",
                "--expert-cache",
                "3",
                "--events",
                str(events),
                "--no-stream",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    rows = read_jsonl(events / "inference.jsonl")
    assert rows[-1]["tokens"] == report["new_tokens"] == 12
    last = rows[-1]
    assert last["cache_hits"] + last["cache_misses"] > 0 and 0 <= last["cache_hit_rate"] <= 1
    assert last["experts_resident"] == 3  # the cache is full at capacity
    assert last["cache_hit_rate"] == report["expert_cache"]["hit_rate"]
    text = (events / "inference.jsonl").read_text()
    assert "secret" not in text and "cat" not in text  # numbers only

    c = TestClient(create_app([tmp_path / "runs"]))
    run = c.get("/api/runs").json()["runs"][0]
    assert run["kind"] == "inference" and run["name"] == "serving"
    series = c.get(
        f"/api/runs/{run['id']}/scalars?keys=tokens_per_s,cache_hit_rate,experts_resident,rerouted_tokens"
    ).json()["series"]
    assert series["experts_resident"]["y"][-1] == 3 and series["cache_hit_rate"]["x"][-1] == 12
