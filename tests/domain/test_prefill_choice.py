"""`--prefill-kernels auto` (domain/prefill_choice.py, ADR 0020): its table, case by case, with the reason."""

import pytest

from domain.model_spec import WeightFormat as F
from domain.prefill_choice import GPU_VALIDATED_FORMATS, PREFILL_KERNELS, resolve_prefill_kernels


def auto(expert, dense=(), device="cuda", fast_path=True):
    return resolve_prefill_kernels("auto", device=device, fast_path=fast_path, expert_format=expert,
                                   dense_formats=dense)


def test_only_unquantized_block_fp8_and_nvfp4_weights_are_validated():
    # NOTE: widening this set turns the Triton prefill on for users of that format: only after a GPU run passed
    assert GPU_VALIDATED_FORMATS == {F.BF16, F.FP8_BLOCK, F.NVFP4}
    assert PREFILL_KERNELS == ("auto", "reference", "triton")


@pytest.mark.parametrize("expert, dense", [
    (F.BF16, {F.BF16}),  # unquantized (bf16, fp16 and fp32 checkpoints are all held as float weights)
    (F.FP8_BLOCK, {F.BF16, F.FP8_BLOCK}),  # block FP8 experts and projections, float norms and embeddings
    (F.FP8_BLOCK, {F.BF16}),  # block FP8 experts, projections left unquantized
    (F.BF16, ()),  # dense formats not given: the experts decide
    (F.NVFP4, {F.BF16, F.NVFP4}),  # an NVFP4 checkpoint (either layout: both are read into one form)
])
def test_cuda_fast_path_with_validated_formats_runs_the_triton_prefill(expert, dense):
    choice = auto(expert, dense)
    assert (choice.requested, choice.kernels, choice.triton) == ("auto", "triton", True)
    assert "CUDA fast path" in choice.reason and f"experts {expert.value}" in choice.reason


@pytest.mark.parametrize("device, fast_path, why", [
    ("cpu", False, "cpu has no Triton prefill"),
    ("cpu", True, "cpu has no Triton prefill"),  # the fast path forced on the CPU (Triton's interpreter, tests)
    ("cuda", False, "the reference executor serves"),  # --executor reference, --mmap-experts, --record-routing
    ("cuda:1", False, "the reference executor serves"),
])
def test_without_the_cuda_fast_path_auto_is_the_reference_prefill(device, fast_path, why):
    choice = auto(F.BF16, {F.BF16}, device=device, fast_path=fast_path)
    assert (choice.kernels, choice.triton) == ("reference", False)
    assert why in choice.reason


@pytest.mark.parametrize("expert", [F.MXFP4, F.INT8_CHANNEL, F.FP8_TENSOR, F.FP8_CHANNEL])
def test_experts_in_a_format_not_validated_on_a_gpu_keep_the_reference_prefill(expert):
    choice = auto(expert, {F.BF16})
    assert choice.kernels == "reference"
    assert f"not GPU-validated with experts {expert.value}" in choice.reason
    assert "--prefill-kernels triton forces it" in choice.reason


@pytest.mark.parametrize("dense", [F.MXFP4, F.INT8_CHANNEL, F.FP8_TENSOR, F.FP8_CHANNEL])
def test_one_dense_projection_in_a_format_not_validated_keeps_the_reference_prefill(dense):
    # a mixed-precision checkpoint: block-FP8 experts, some projections in another format
    choice = auto(F.FP8_BLOCK, {F.BF16, F.FP8_BLOCK, dense})
    assert choice.kernels == "reference"
    assert f"dense {dense.value}" in choice.reason and "experts fp8_block" not in choice.reason


def test_an_unknown_expert_format_is_not_validated():
    choice = auto(None, {F.BF16})
    assert choice.kernels == "reference" and "unknown format" in choice.reason


@pytest.mark.parametrize("requested", ["reference", "triton"])
@pytest.mark.parametrize("device, fast_path, expert", [("cuda", True, F.BF16), ("cuda", True, F.NVFP4),
                                                       ("cpu", False, None)])
def test_explicit_settings_are_taken_as_asked(requested, device, fast_path, expert):
    choice = resolve_prefill_kernels(requested, device=device, fast_path=fast_path, expert_format=expert)
    assert (choice.requested, choice.kernels) == (requested, requested)
    assert choice.reason == f"--prefill-kernels {requested}"


def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="auto, reference, triton"):
        resolve_prefill_kernels("fast", device="cuda", fast_path=True, expert_format=F.BF16)
