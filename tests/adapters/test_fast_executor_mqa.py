"""test_fast_executor.py's tests that take a checkpoint, on the second parity config (alternating_mqa: full
attention with one KV head in every other layer). A file of its own so that pytest-xdist (--dist loadfile)
runs the two configs on two workers: together they were the suite's longest file (docs/testing.md)."""

import pytest

from tests.adapters.test_fast_executor import (  # noqa: F401  (collected here with this module's ckpt)
    make_ckpt,
    test_a_decode_step_reads_its_tokens_and_the_expert_counters_back_in_one_copy,
    test_a_rollback_after_a_failed_allocation_restores_the_fast_executors_pools,
    test_bf16_fast_path_stays_within_bf16_error_of_the_reference,
    test_decode_logits_are_bitwise_identical_at_any_slot_count,
    test_decode_steps_take_the_fused_routing_and_gdn_kernels,
    test_every_decode_bucket_tunes_the_norm_router_before_its_capture,
    test_fast_path_matches_the_reference_executor,
    test_padded_rows_route_nowhere_and_do_not_change_real_rows,
    test_sampled_decoding_draws_the_reference_executors_tokens,
    test_the_default_prefill_keeps_the_reference_token_mixers,
    test_the_first_graph_capture_is_reported_as_a_start_up_phase,
    test_the_launch_hook_is_called_once_per_step_and_before_the_tokens_are_read_back,
)


@pytest.fixture(scope="module", params=["alternating_mqa"])
def ckpt(request, tmp_path_factory):
    return make_ckpt(request.param, tmp_path_factory)
