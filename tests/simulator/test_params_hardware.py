"""Parameter objects reject unknown fields; hardware profiles load from JSON and TOML."""

import json

import pytest

from simulator.cost_model import CostParams
from simulator.hardware import BUILTIN_PROFILES, get_profile, load_profiles
from simulator.predict import Deployment, Workload


def test_builtin_profiles_carry_the_spec_figures():
    assert set(BUILTIN_PROFILES) == {"rtx3090", "rtx4090", "rtx5090", "rtx4060-laptop", "h200", "h100"}
    assert get_profile("rtx3090").h2d_bytes_per_s == 25.3e9
    assert get_profile("rtx5090").h2d_bytes_per_s == 52.7e9
    assert get_profile("rtx4060-laptop").memory_bytes_per_s == 256e9
    assert get_profile("h200").pageable_h2d_bytes_per_s == 6.8e9


def test_the_h100_is_the_h200s_die_with_less_and_slower_memory():
    # session 25's card: 'NVIDIA H100 80GB HBM3' (SXM5), memory as CUDA reported it, the link as measured on it
    h100, h200 = get_profile("h100"), get_profile("h200")
    assert h100.vram_bytes == 85_017_493_504 and h100.h2d_bytes_per_s == 54.6e9
    assert h100.memory_bytes_per_s == 3.35e12 < h200.memory_bytes_per_s
    assert h100.bf16_flops == h200.bf16_flops == 989e12  # GH100, 132 SMs, the same clocks
    assert h100.pageable_h2d_bytes_per_s == 0.0  # not measured


@pytest.mark.parametrize("cls", [CostParams, Workload, Deployment])
def test_unknown_fields_are_errors(cls):
    with pytest.raises(ValueError, match="unknown field"):
        cls.from_dict({"definitely_not_a_field": 1})


def test_out_of_range_values_are_errors():
    with pytest.raises(ValueError, match="memory_efficiency"):
        CostParams.from_dict({"memory_efficiency": 1.5})
    with pytest.raises(ValueError, match="step_overhead_s"):
        CostParams.from_dict({"step_overhead_s": -1.0})
    with pytest.raises(ValueError, match="measure_tokens"):
        Workload.from_dict({"measure_tokens": 0})


def test_replace_round_trips_and_validates():
    p = CostParams().replace(step_overhead_s=0.01)
    assert CostParams.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError):
        p.replace(h2d_efficiency=0)


PROFILE = {"name": "my-a6000", "vram_bytes": 48 * 2**30, "h2d_bytes_per_s": 24e9,
           "memory_bytes_per_s": 768e9, "bf16_flops": 150e12}


def test_user_profiles_from_json_and_toml(tmp_path):
    j = tmp_path / "p.json"
    j.write_text(json.dumps({"profiles": [PROFILE]}))
    t = tmp_path / "p.toml"
    t.write_text("[[profiles]]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in PROFILE.items()))
    for path in (j, t):
        profiles = load_profiles(path)
        assert profiles["my-a6000"].memory_bytes_per_s == 768e9
        assert get_profile("my-a6000", profiles).name == "my-a6000"


def test_user_profile_typos_are_rejected(tmp_path):
    j = tmp_path / "p.json"
    j.write_text(json.dumps({**PROFILE, "memory_bandwith": 1}))
    with pytest.raises(ValueError, match="memory_bandwith"):
        load_profiles(j)
    with pytest.raises(ValueError, match="unknown hardware"):
        get_profile("rtx9999")


@pytest.mark.parametrize("field", ["vram_bytes", "host_ram_bytes", "h2d_bytes_per_s", "memory_bytes_per_s"])
def test_a_profile_written_in_gb_is_refused_as_such(tmp_path, field):
    # a user who wrote vram_bytes = 24 got "pool budget is -4294967275 bytes" from deep in the planner
    entry = {"name": "gb-card", "vram_bytes": 24 * 2**30, "h2d_bytes_per_s": 25e9, "memory_bytes_per_s": 900e9,
             "bf16_flops": 70e12, "host_ram_bytes": 64 * 2**30, field: 24}
    path = tmp_path / "gb.json"
    path.write_text(json.dumps(entry))
    with pytest.raises(ValueError, match=f"{field} = 24 looks like GB, expected bytes"):
        load_profiles(path)


def test_the_documented_hardware_file_example_loads(tmp_path):
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs/simulator.md").read_text()
    section = doc.split("## Hardware-file format", 1)[1].split("\n## ", 1)[0]
    example = section.split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "acme-a20.toml"
    path.write_text(example)
    card = load_profiles(path)["acme-a20"]
    assert card.vram_bytes == 20 * 2**30 and card.h2d_bytes_per_s == 24e9 and card.host_ram_bytes == 64 * 2**30
