"""Short prompts as decode replays in the simulator (ADR 0026; SimExecutor "Short prompts as decode replays"): the
server's default, a replayed step costs its replays as decode steps, and the deployment, the CLI and `mixed --record`
carry the setting. The rule (which row goes to which replay) is the domain's, shared with the server's executor
(tests/adapters/test_short_prompt_replays.py)."""

import json
from pathlib import Path

import pytest

from adapters.cuda_exec import short_prompts as server
from domain.ports import SequenceWork, StepBatch
from domain.request import SamplingParams
from domain.short_prompt_replays import DEFAULT_TOKENS
from simulator import short_prompts
from simulator.__main__ import main
from simulator.cost_model import CostModel, CostParams
from simulator.hardware import get_profile
from simulator.host import SimHost
from simulator.mixed_record import read_record
from simulator.predict import Deployment
from simulator.routing import UniformRouting
from simulator.sim_executor import SimExecutor

from .conftest import tiny_spec

BENCH = Path(__file__).resolve().parents[2] / "docs/bench"
SPEC = tiny_spec()  # 4 layers, 16 experts, top-2
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
BUCKETS = (1, 2, 4)


def _chunk(rid: str, tokens: int, start: int = 16, slot: int = 0) -> SequenceWork:
    """A prompt chunk resuming a cached prefix of `start` tokens (the benchmarks' repeated prompt)."""
    return SequenceWork(rid, tuple(range(100, 100 + tokens)), start, tuple(range(slot * 4, slot * 4 + 3)), slot, True,
                        GREEDY, 0, restore_from=slot, snapshots=((start + tokens, 8 + slot),))


def _decode(rid: str, slot: int, position: int = 20) -> SequenceWork:
    return SequenceWork(rid, (7,), position, (40 + slot, 41 + slot), slot, True, GREEDY, 3)


def test_the_default_is_the_servers():
    assert server.MAX_TOKENS == DEFAULT_TOKENS == short_prompts.resolve(None) == 8  # unset in the test environment
    assert Deployment().short_prompt_replays is None and short_prompts.resolve(0) == 0
    assert "short_prompt_replays" not in Deployment().to_dict()  # calibrations state it only where it is not auto


def _executor(replays: int, slots: int = 64) -> SimExecutor:
    cost = CostModel(SPEC, get_profile("h100"), CostParams(graph_buckets=BUCKETS, lookup_max_keys=16,
                                                           host_step_s=1e-4, host_row_s=1e-5, server_step_s=2e-4,
                                                           eager_mixer_layer_s=1e-3, step_overhead_s=5e-4))
    ex = SimExecutor(SimHost(), cost, UniformRouting(4, 16, 2, seed=3), slots, short_prompt_replays=replays)
    for layer in range(SPEC.num_layers):  # every expert resident: no copies
        ex.residency.lookup([(layer, e) for e in range(SPEC.num_experts)])
        ex.residency.release()
    return ex


def _run(ex: SimExecutor, *batches) -> float:
    t0 = ex.host.now()
    for works in batches:
        ex.execute(StepBatch(tuple(works)))
    return ex.host.now() - t0


def test_a_replayed_step_costs_its_replays_as_decode_steps():
    chunk, decodes = _chunk("p", 3), [_decode(f"d{i}", i + 1) for i in range(3)]
    replayed = _executor(8)
    took = _run(replayed, [chunk, *decodes])
    assert (replayed.counters.replayed_steps, replayed.counters.replays, replayed.counters.steps) == (1, 3, 1)
    assert (replayed.counters.prefill_tokens, replayed.counters.decode_tokens) == (3, 3)
    # the same rows as decode-only steps of an executor without replays: replay 0 (the chunk's first row beside the
    # decodes, bs4), then its second and third rows alone (bs1); the rows route through the chunk's stream
    twin = _executor(0)
    twin._stream_keys.key_for(chunk)
    rows = [SequenceWork("p", (t,), 16 + r, chunk.page_ids, 0, True, GREEDY, 1) for r, t in enumerate(chunk.token_ids)]
    server_s = twin.cost.params.server_step_s
    expected = _run(twin, [rows[0], *decodes], [rows[1]], [rows[2]]) - 2 * server_s  # one engine step: paid once
    assert took == pytest.approx(expected, rel=1e-12)
    assert twin.counters.replayed_steps == 0
    # off, the step is the short eager step it was: its token mixers launched layer by layer from the host
    assert _run(_executor(0), [chunk, *decodes]) > 4 * 1e-3


@pytest.mark.parametrize("works, replays", [
    ([_chunk("p", 9)], 8),  # a chunk longer than the setting
    ([_chunk(f"p{i}", 2, slot=i) for i in range(5)], 8),  # a replay of 5 rows > the largest bucket (4)
    ([_chunk("p", 2)], 0),  # off
    ([_chunk("p", 2)], 1),  # 1: no chunk of 2+ tokens can qualify
])
def test_steps_the_server_does_not_replay_run_as_before(works, replays):
    ex = _executor(replays)
    _run(ex, works)
    assert ex.counters.replayed_steps == 0


def test_the_deployment_refuses_a_bad_setting():
    for bad in (-1, True, 2.0, "auto"):
        with pytest.raises(ValueError, match="short_prompt_replays"):
            Deployment().replace(short_prompt_replays=bad)
    with pytest.raises(ValueError, match="short_prompt_replays"):
        SimExecutor(SimHost(), CostModel(SPEC, get_profile("h100"), CostParams()), UniformRouting(4, 16, 2), 8,
                    short_prompt_replays=-1)


def _predict(capsys, *extra) -> list[dict]:
    assert main(["predict", "--hardware", "h100", "--model", "qwen3.6-35b-a3b-fp8", "--kv", "65536", "--batch", "1",
                 "--max-running-requests", "4", "--routing", "uniform", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_predict_runs_the_servers_default_and_the_flag_turns_it_off(capsys):
    (on,) = _predict(capsys)  # auto: the server's default, 8
    (off,) = _predict(capsys, "--short-prompt-replays", "0")
    assert (on["scheduler"]["short_prompt_replays"], off["scheduler"]["short_prompt_replays"]) == (8, 0)
    (partial,) = _predict(capsys, "--gpu-budget-gib", "24")  # the same at every plan, experts left out or not
    assert partial["scheduler"]["short_prompt_replays"] == 8
    # the benchmark's repeated prompt leaves 2 uncached tokens: 2 decode replays at bs1 instead of one short step
    assert on["ttft_s"] != off["ttft_s"]
    (customer,) = _predict(capsys, "--calibration", "rtx3090_v2")
    assert customer["scheduler"]["short_prompt_replays"] == 0  # the customer's engine has no such path


def test_mixed_record_reads_the_setting_from_when_the_record_was_served():
    assert read_record(BENCH / "2026-12-05-h100-mixed-24gib-512-layered.json").arguments["short_prompt_replays"] == 0
    # session 32's A/B pair set the variable by hand; the record does not say it, so the one at 8 needs the flag
    assert read_record(BENCH / "2026-12-06-s32-h100-mixed-24gib-layered-replays0.json").arguments[
        "short_prompt_replays"] == 0
    record = {"started_at": "2026-12-01T00:00:00+00:00",
              "server": {"stats": {"executor": {"short_prompt_replays": 4}}}}
    assert short_prompts.served_replays(record) == 4  # what the server states wins
    assert short_prompts.served_replays({"started_at": "2026-12-07T09:00:00+00:00"}) is None  # later: auto
    with pytest.raises(ValueError, match="time zone"):
        short_prompts.served_replays({"started_at": "2026-12-06T09:00:00"})
