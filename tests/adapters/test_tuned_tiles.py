"""tuned_tiles reads the autotuners' choices per key (what bench records and the start-up log report about the
W_LHS A/B); in the interpreter nothing is tuned, so a stand-in autotuner with a filled cache plays the GPU's."""

from __future__ import annotations

from types import SimpleNamespace

import triton

from adapters.kernels import tuned_tiles as tt


def _tuner(*entries):
    return SimpleNamespace(cache=dict(entries))


def test_each_tuned_key_is_listed_with_its_tile_and_whether_it_is_a_w_lhs_tile():
    w_lhs = triton.Config({"BLOCK_N": 64, "BLOCK_K": 128, "W_LHS": True}, num_warps=8, num_stages=3)
    right = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=8, num_stages=3)
    tiles = tt.tuned_tiles({"a": _tuner(((4096, 4096, 2048, 1, False, "torch.bfloat16"), right)),
                            "b": _tuner(((16, 2048, 512), w_lhs), ((64, 2048, 512), right)), "c": _tuner()})
    assert tiles["a"] == [{"key": [4096, 4096, 2048, 1, False, "torch.bfloat16"],
                           "tile": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
                           "w_lhs": False}]
    assert [r["w_lhs"] for r in tiles["b"]] == [True, False] and tiles["c"] == []
    assert tt.w_lhs_wins(tiles) == (1, 3)


def test_every_gemm_with_w_lhs_tiles_is_read_and_nothing_is_tuned_in_the_interpreter():
    tiles = tt.tuned_tiles()
    assert set(tiles) == {"dense_gemm", "moe_grouped_gate_up", "moe_grouped_down", "dense_gemm_splitk"}
    assert tt.w_lhs_wins(tiles)[0] <= tt.w_lhs_wins(tiles)[1]
