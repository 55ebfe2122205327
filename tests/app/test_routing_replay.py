"""`ft serve --routing-replay` end to end on the embedded demo model (4 layers, top-2 of 8 experts), real
servers on 127.0.0.1 driven by the official openai client:

- the mode is visible in /health, /v1/stats and /metrics, and POST /v1/routing switches it (409 on a server
  that routes naturally only);
- a trace recorded by `--record-routing` from natural routing and replayed gives exactly the recorded expert
  ids (the replaying server records what it used) and the same completions;
- at a small expert-slot count the locality model yields the hit rate its parameters imply: the server's
  hits and misses equal the domain LRU run over the simulator's stream for the request, a sticky
  configuration hits far more often than a scattering one, and natural routing differs from both.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.containers import Container, check_routing_replay
from app.serving import RunningServer
from app.settings import ServeSettings
from domain.ports import SequenceWork
from domain.request import SamplingParams
from domain.residency import ExpertResidency
from domain.routing_streams import stream_key
from simulator.replay_source import replay_source

pytest.importorskip("app.demo_model", reason="the demo model checkpoint has not been committed yet")
from app.demo_model import DEMO_MODEL_NAME  # noqa: E402

LAYERS, EXPERTS, TOP_K = 4, 8, 2
SLOTS = 12  # of 32: a layer's two experts per token, four layers a token; well below the whole model
STICKY = "locality:p_prev=1.0,p_recent=0.0,seed=1"  # every pick copies the previous token's experts
SCATTERED = "locality:p_prev=0.0,p_recent=0.0,popularity_tau=100.0,seed=1"  # fresh, nearly uniform picks
PROMPTS = [[11, 40, 7, 93, 21, 5, 60, 14, 3], [2, 33, 71, 8, 19], [101, 4, 4, 57, 230, 12, 9]]
NEW_TOKENS = 20


def _server(**kw) -> RunningServer:
    settings = ServeSettings(port=0, device="cpu", max_running_requests=2, **kw)
    check_routing_replay(settings)
    return RunningServer(Container(), settings).start(wait_ready=120)


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def _complete(client: openai.OpenAI, prompt: list[int]) -> tuple[str, int]:
    r = client.completions.create(model=DEMO_MODEL_NAME, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == NEW_TOKENS
    return r.choices[0].text, r.usage.prompt_tokens


def _counters(server: RunningServer) -> tuple[int, int]:
    found = {}
    for family in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text):
        for s in family.samples:
            if s.name in ("ft_expert_hits_total", "ft_expert_misses_total"):
                found[s.name] = int(s.value)
    return found["ft_expert_hits_total"], found["ft_expert_misses_total"]


def _streams(path) -> list[list]:
    by: dict[str, list] = {}
    for line in path.read_text().splitlines():
        x = json.loads(line)
        by.setdefault(x["stream"], []).append(x["layer_experts"])
    return list(by.values())


def _predicted(spec: str, prompts: list[list[int]]) -> tuple[int, int]:
    """The domain LRU over the simulator's streams, looked up as the reference executor does: one step for
    the prompt (it fits one prefill chunk), then one per fed-back token; per layer the step's distinct
    experts in ascending order."""
    source = replay_source(spec, LAYERS, EXPERTS, TOP_K)
    lru = ExpertResidency(SLOTS)
    for prompt in prompts:
        first = SequenceWork("x", tuple(prompt), 0, (), 0, True, SamplingParams(temperature=0.0), 0)
        tokens = source.tokens(stream_key(first), 0, len(prompt) + NEW_TOKENS - 1)
        steps = [tokens[:len(prompt)]] + [[t] for t in tokens[len(prompt):]]
        for step in steps:
            for layer in range(LAYERS):
                keys = [(layer, e) for e in sorted({e for token in step for e in token[layer]})]
                lru.lookup(keys)
                lru.release(keys)
    return lru.hits, lru.misses


@pytest.fixture(scope="module")
def sticky():
    server = _server(routing_replay=STICKY, moe_slots=SLOTS)
    yield server
    server.stop()


def test_the_replay_is_shown_on_health_stats_and_metrics_and_can_be_switched(sticky):
    base = sticky.base_url
    health = httpx.get(base + "/health").json()
    routing = health["routing"]
    assert routing["mode"] == "locality" and routing["active"] is True and routing["seed"] == 1
    assert routing["spec"].startswith("locality:p_prev=1.0,p_recent=0.0,") and routing["params"]["p_prev"] == 1.0
    assert httpx.get(base + "/v1/stats").json()["routing"]["spec"] == routing["spec"]
    metrics = httpx.get(base + "/metrics").text
    assert f'ft_routing{{mode="locality",spec="{routing["spec"]}"}} 1.0' in metrics
    assert 'ft_routing{mode="natural",spec="natural"} 0.0' in metrics
    off = httpx.post(base + "/v1/routing", json={"replay": False})
    assert off.status_code == 200 and off.json()["active"] is False
    assert 'ft_routing{mode="natural",spec="natural"} 1.0' in httpx.get(base + "/metrics").text
    assert httpx.get(base + "/health").json()["routing"]["active"] is False
    assert httpx.post(base + "/v1/routing", json={"replay": True}).json()["active"] is True
    bad = httpx.post(base + "/v1/routing", json={"replay": "maybe"})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "replay"


def test_a_natural_server_says_so_and_refuses_to_switch():
    server = _server()
    try:
        assert httpx.get(server.base_url + "/health").json()["routing"] == {"mode": "natural"}
        assert httpx.get(server.base_url + "/v1/stats").json()["routing"] == {"mode": "natural"}
        assert 'ft_routing{mode="natural",spec="natural"} 1.0' in httpx.get(server.base_url + "/metrics").text
        r = httpx.post(server.base_url + "/v1/routing", json={"replay": True})
        assert r.status_code == 409 and r.json()["error"]["code"] == "no_routing_replay"
    finally:
        server.stop()


def test_bad_specs_are_refused_before_anything_loads(tmp_path):
    for spec, match in [("locality:p_prev=2", "p_prev"), ("locality:bogus=1", "unknown field"),
                        ("uniform:p_prev=0.5", "only seed"), (f"trace:{tmp_path}/none.jsonl", "not a readable"),
                        ("zipf", "must be locality")]:
        with pytest.raises(ValueError, match=match):
            check_routing_replay(ServeSettings(routing_replay=spec))


def test_a_replayed_trace_gives_exactly_the_recorded_expert_ids(tmp_path):
    recorded, replayed = tmp_path / "natural.jsonl", tmp_path / "replayed.jsonl"
    outputs = []
    for kw in ({"record_routing": str(recorded)},
               {"record_routing": str(replayed), "routing_replay": f"trace:{recorded}"}):
        server = _server(**kw)
        try:
            client = _client(server)
            outputs.append([_complete(client, p)[0] for p in PROMPTS])
        finally:
            server.stop()
    natural, replay = _streams(recorded), _streams(replayed)
    assert len(natural) == len(PROMPTS)
    assert [len(s) for s in natural] == [len(p) + NEW_TOKENS - 1 for p in PROMPTS]
    assert replay == natural  # request k replayed recorded stream k, position by position
    assert outputs[1] == outputs[0]  # the router's own weights at the same ids: the natural completions


def test_locality_yields_its_hit_rate_at_a_small_slot_count(sticky):
    measured, starts = {}, {}
    for name, spec in (("sticky", STICKY), ("scattered", SCATTERED), ("natural", None)):
        server = sticky if name == "sticky" else _server(moe_slots=SLOTS, **({"routing_replay": spec} if spec else {}))
        try:
            starts[name] = before = _counters(server)
            client = _client(server)
            for p in PROMPTS:
                _complete(client, p)
            after = _counters(server)
            measured[name] = (after[0] - before[0], after[1] - before[1])
        finally:
            if server is not sticky:
                server.stop()
    # the LRU started empty on every server (the prediction starts from an empty LRU too)
    assert starts == {"sticky": (0, 0), "scattered": (0, 0), "natural": (0, 0)}
    assert measured["sticky"] == _predicted(STICKY, PROMPTS)
    assert measured["scattered"] == _predicted(SCATTERED, PROMPTS)

    def rate(name):
        hits, misses = measured[name]
        return hits / (hits + misses)

    # the demo model's trained router sits between the two configurations (measured: 0.88, 0.72, 0.21)
    assert rate("sticky") > 0.85 and rate("scattered") < 0.3, measured
    assert rate("sticky") > rate("natural") > rate("scattered"), measured


def test_ft_bench_measures_the_replay_and_natural_routing_beside_it(sticky, tmp_path):
    from app.cli import main

    out = tmp_path / "sweep.json"
    code = main(["bench", "sweep", "--base-url", sticky.base_url, "--kv", "current", "--batch", "1", "--warmup", "1",
                 "--warmup-tokens", "4", "--iterations", "1", "--tokens", "12", "--no-bandwidth", "--quiet",
                 "--out", str(out)])
    assert code == 0
    replay = json.loads(out.read_text())
    natural_out = tmp_path / "sweep-natural.json"
    natural = json.loads(natural_out.read_text())
    spec = replay["routing_replay"]["spec"]
    assert replay["routing"] == spec and spec.startswith("locality:p_prev=1.0")
    assert natural["routing"] == "natural" and natural["routing_replay"]["active"] is False
    assert replay["linked_records"] == {"natural": str(natural_out)} and natural["linked_records"] == {"replay": str(out)}
    assert replay["settings"]["routing"] == "both"
    # the figures differ where the routing does: the sticky replay hits more often than the demo's router
    assert replay["points"][0]["hit_rate"] > natural["points"][0]["hit_rate"]
    assert httpx.get(sticky.base_url + "/health").json()["routing"]["active"] is True  # left as found
    code = main(["bench", "smoke", "--base-url", sticky.base_url, "--routing", "natural", "--no-bandwidth", "--quiet",
                 "--out", str(tmp_path / "smoke.json")])
    smoke = json.loads((tmp_path / "smoke.json").read_text())
    assert smoke["routing"] == "natural" and smoke["linked_records"] == {} and smoke["ok"] is True
    assert not (tmp_path / "smoke-natural.json").exists()
    assert httpx.get(sticky.base_url + "/health").json()["routing"]["active"] is True


def test_ft_serve_exits_2_on_a_bad_spec_before_loading(capsys):
    from app.cli import main

    assert main(["serve", "--port", "0", "--device", "cpu", "--routing-replay", "locality:p_prev=3"]) == 2
    assert "p_prev" in capsys.readouterr().err
