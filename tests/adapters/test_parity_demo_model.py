"""The trained demo model (a real, well-conditioned qwen3_5_moe, app/demo_model/checkpoint) through
TorchExecutor vs transformers fp32: fp32 to 1e-4 of the logit scale, and bf16 — where random tiny models
are too ill-conditioned to judge — within 2e-2 with 16 identical greedy tokens."""

from pathlib import Path

import pytest
import torch

from adapters.checkpoint.loader import load_checkpoint
from adapters.torch_exec.executor import TorchExecutor
from domain.ports import SequenceWork, StepBatch
from tests.adapters.torch_exec_models import GREEDY, hf_greedy, make_plan, pages_for

DEMO_DIR = Path(__file__).resolve().parents[2] / "app" / "demo_model" / "checkpoint"
QUESTIONS = ("What is 62 + 17?", "What is 7 - 30?", "What is 99 + 99?", "What is 0 - 58?")
STEPS = 16

pytestmark = pytest.mark.skipif(not (DEMO_DIR / "model.safetensors").exists(), reason="demo checkpoint absent")


@pytest.fixture(scope="module")
def demo():
    from tokenizers import Tokenizer
    from transformers import Qwen3_5MoeForCausalLM

    model = Qwen3_5MoeForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32).eval()
    return model, Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json")), load_checkpoint(DEMO_DIR, progress=False)


def teacher_forced_logits(executor, prompt, forced) -> torch.Tensor:
    """Prefill in chunks of 8, then one decode step per forced token: [len(prompt) + len(forced), V]."""
    pages = pages_for(1, len(prompt) + len(forced) + 1)
    rows = []
    for start in range(0, len(prompt), 8):
        part = tuple(prompt[start:start + 8])
        work = SequenceWork("r", part, start, pages, 0, start + len(part) == len(prompt), GREEDY, 0)
        rows.append(executor.compute_logits(StepBatch((work,)), all_positions=True)["r"])
    for i, token in enumerate(forced):
        work = SequenceWork("r", (token,), len(prompt) + i, pages, 0, True, GREEDY, i + 1)
        rows.append(executor.compute_logits(StepBatch((work,)))["r"])
    return torch.cat(rows).float()


def reference(model, prompt):
    """transformers fp32: logits [P + STEPS, V] over prompt and greedy continuation, and the tokens."""
    prefill, decode, tokens = hf_greedy(model, prompt, STEPS)
    return torch.cat([prefill, torch.stack(decode)]).float(), tokens


def prompts(tokenizer):
    return [tokenizer.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n").ids for q in QUESTIONS]


def test_demo_model_fp32_matches_transformers(demo):
    model, tokenizer, ckpt = demo
    executor = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=4), "cpu", torch.float32)
    for question, prompt in zip(QUESTIONS, prompts(tokenizer), strict=True):
        ref, tokens = reference(model, prompt)
        answer = str(eval(question.removeprefix("What is ").removesuffix("?")))  # noqa: S307 (fixed strings)
        assert tokenizer.decode(tokens[:len(answer)]) == answer, "the reference itself must answer correctly"
        ours = teacher_forced_logits(executor, prompt, tokens[:STEPS])
        assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max(), question
        assert ours[len(prompt) - 1:].argmax(-1).tolist() == tokens, question


def test_demo_model_bf16_is_as_close_as_transformers_bf16(demo):
    """bf16 rounding noise is heavy-tailed (a few positions reach several %, for transformers' own bf16
    too), so judge the typical error: the median per-position relative error over every position of
    every question must stay within 2e-2 and within 1.25x transformers' bf16; and every greedy token
    (teacher-forced, 17 per question) whose fp32 lead exceeds that 2e-2 tolerance must match fp32."""
    import copy

    model, tokenizer, ckpt = demo
    model16 = copy.deepcopy(model).to(torch.bfloat16)
    executor = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=4), "cpu", torch.bfloat16)
    ours_err, theirs_err = [], []
    for question, prompt in zip(QUESTIONS, prompts(tokenizer), strict=True):
        ref, tokens = reference(model, prompt)
        ours = teacher_forced_logits(executor, prompt, tokens[:STEPS])
        with torch.no_grad():
            theirs = model16(torch.tensor([prompt + tokens[:STEPS]])).logits[0].float()
        scale = ref.abs().amax(-1)  # [P + STEPS]
        ours_err.append((ours - ref).abs().amax(-1) / scale)
        theirs_err.append((theirs - ref).abs().amax(-1) / scale)
        # NOTE: a position whose fp32 top-1 lead is below the bf16 tolerance is a near tie that bf16
        # rounding may legitimately flip (seen once after the end of turn: lead 1.7e-2 of the scale);
        # every other greedy token must match, and at least 16 of the 17 per question are judged.
        top2 = ref[len(prompt) - 1:].topk(2, dim=-1).values  # [STEPS + 1, 2]
        decisive = ((top2[:, 0] - top2[:, 1]) / scale[len(prompt) - 1:]) > 2e-2
        assert int(decisive.sum()) >= STEPS, f"{question}: too few decisive positions to judge"
        ours_tokens = ours[len(prompt) - 1:].argmax(-1)
        agree = ours_tokens == torch.tensor(tokens)
        assert bool(agree[decisive].all()), f"{question}: greedy tokens differ at decisive positions"
    ours_median = torch.cat(ours_err).median().item()
    theirs_median = torch.cat(theirs_err).median().item()
    print(f"bf16 median relative logit error: ours {ours_median:.4f}, transformers {theirs_median:.4f}")
    assert ours_median <= 2e-2, ours_median
    assert ours_median <= 1.25 * theirs_median, (ours_median, theirs_median)
