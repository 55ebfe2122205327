"""Train fluxtide's embedded demo model: a tiny qwen3_5_moe that does two-number arithmetic.

Shape legend: B batch, L sequence length, V vocabulary.

Task: the user asks "What is A + B?" or "What is A - B?" (A, B in 0..99) and the assistant
answers with the number, written normally ("What is 7 - 30?" -> "-23"), then <|im_end|>.
A fixed 10 % of the 20,000 (A, op, B) questions is held out (never trained on, never used
for early stopping); a further 500 training-side questions are the validation set that
decides when to stop. The script builds a byte-level BPE tokenizer (one token per digit),
trains Qwen3_5MoeForCausalLM with loss only on the answer tokens, reports greedy exact-match
accuracy on the held-out set and writes an ordinary Hugging Face checkpoint directory.

It deliberately imports nothing from fluxtide, so it runs on any machine with torch,
transformers (>= 5.2), tokenizers and safetensors.

    python scripts/train_demo_model.py --device cuda --steps 4000 --out /tmp/demo
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]
# Qwen's pre-tokenizer pattern: \p{N} alone means every digit is its own token.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = message['content'] | map(attribute='text') | join('') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPLIT_SEED = 20_260_101  # fixes the held-out set independently of the training seed
HELDOUT_FRACTION = 0.10
VALIDATION_SIZE = 500
OPERATORS = ("+", "-")


# ---------------------------------------------------------------- task


def all_questions() -> list[tuple[int, str, int]]:
    return [(a, op, b) for a in range(100) for op in OPERATORS for b in range(100)]


def question_text(a: int, op: str, b: int) -> str:
    return f"What is {a} {op} {b}?"


def answer_text(a: int, op: str, b: int) -> str:
    return str(a + b if op == "+" else a - b)


# Half the training rows open with one of these system messages, so that clients which always
# send one (many do) still get the answer; "" is an empty system turn.
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a calculator. Answer with the number only.",
                  "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", "")


def prompt_text(a: int, op: str, b: int, system: str | None = None) -> str:
    """The chat template's rendering of [system,] user turn plus the generation prompt."""
    head = "" if system is None else f"{IM_START}system\n{system}{IM_END}\n"
    return f"{head}{IM_START}user\n{question_text(a, op, b)}{IM_END}\n{IM_START}assistant\n"


def split_questions() -> tuple[list, list, list]:
    """(train, validation, held-out); the held-out set depends only on SPLIT_SEED."""
    questions = all_questions()
    shuffled = questions[:]
    random.Random(SPLIT_SEED).shuffle(shuffled)
    n_heldout = int(len(questions) * HELDOUT_FRACTION)
    heldout = sorted(shuffled[:n_heldout])
    validation = sorted(shuffled[n_heldout : n_heldout + VALIDATION_SIZE])
    train = sorted(shuffled[n_heldout + VALIDATION_SIZE :])
    return train, validation, heldout


# ---------------------------------------------------------------- tokenizer


def build_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """Byte-level BPE (any text encodes, no <unk>), digits always single tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [prompt_text(a, op, b) + answer_text(a, op, b) for a, op, b in all_questions()]
    corpus += [prompt_text(0, "+", 0, system) for system in SYSTEM_PROMPTS]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1024,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }


# ---------------------------------------------------------------- model


def model_config(vocab_size: int, pad_id: int, eos_id: int):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.01,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )


# ---------------------------------------------------------------- data


def encode_examples(tokenizer: Tokenizer, questions: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids [N, L] and labels [N, L] (-100 outside the answer): every question
    once without a system message and once with one (SYSTEM_PROMPTS in turn)."""
    pad_id = tokenizer.token_to_id(END_OF_TEXT)
    rows, label_rows = [], []
    variants = [(q, None) for q in questions]
    variants += [(q, SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)]) for i, q in enumerate(questions)]
    for (a, op, b), system in variants:
        prompt = tokenizer.encode(prompt_text(a, op, b, system)).ids
        answer = tokenizer.encode(answer_text(a, op, b) + IM_END).ids
        rows.append(prompt + answer)
        label_rows.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [N, L]
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [N, L]
    for i, (row, lab) in enumerate(zip(rows, label_rows, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(lab)] = torch.tensor(lab)
    return ids, labels


@torch.no_grad()
def greedy_answers(model, tokenizer: Tokenizer, questions: list, device: str, max_new: int = 6,
                   system: str | None = None) -> list[str]:
    """Greedy decoding without a cache or padding: questions are grouped by prompt length."""
    eos_id = tokenizer.token_to_id(IM_END)
    by_length: dict[int, list[int]] = {}
    encoded = [tokenizer.encode(prompt_text(*q, system)).ids for q in questions]
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    answers = [""] * len(questions)
    for indices in by_length.values():
        ids = torch.tensor([encoded[i] for i in indices], device=device)  # [B, L]
        done = torch.zeros(len(indices), dtype=torch.bool, device=device)  # [B]
        generated = []
        for _ in range(max_new):
            next_ids = model(input_ids=ids).logits[:, -1].argmax(-1)  # [B]
            next_ids = torch.where(done, torch.full_like(next_ids, eos_id), next_ids)
            generated.append(next_ids)
            done |= next_ids == eos_id
            ids = torch.cat([ids, next_ids[:, None]], dim=1)  # [B, L+1]
            if bool(done.all()):
                break
        rows = torch.stack(generated, dim=1).tolist()  # [B, steps]
        for i, row in zip(indices, rows, strict=True):
            row = row[: row.index(eos_id)] if eos_id in row else row
            answers[i] = tokenizer.decode(row)
    return answers


def exact_match(model, tokenizer, questions, device, system: str | None = None) -> tuple[float, list]:
    model.eval()
    got = greedy_answers(model, tokenizer, questions, device, system=system)
    model.train()
    wrong = [(q, g) for q, g in zip(questions, got, strict=True) if g != answer_text(*q)]
    return 1.0 - len(wrong) / len(questions), wrong


# ---------------------------------------------------------------- training


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


TIMING_FROM, TIMING_STEPS = 10, 40  # inside the warm-up, whose learning rates do not depend on the total


def fit_steps_to_budget(args, seconds_so_far: float) -> int:
    """Total steps that fit the time budget (eval time included roughly); the warm-up steps
    run so far had the same learning rates under any total, so the run equals one started
    with --steps <printed value> and no budget."""
    per_step = seconds_so_far / (TIMING_STEPS - TIMING_FROM)
    fitted = min(args.steps, max(args.warmup + 1, int(0.8 * args.time_budget_s / per_step)))
    print(f"{per_step * 1000:.1f} ms/step -> {fitted} steps fit the {args.time_budget_s:.0f}s budget", flush=True)
    return fitted


def train(args) -> dict:
    from transformers import Qwen3_5MoeForCausalLM

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False  # same arithmetic as the CPU, for reproducibility

    tokenizer = build_tokenizer()
    pad_id, eos_id = tokenizer.token_to_id(END_OF_TEXT), tokenizer.token_to_id(IM_END)
    train_q, val_q, heldout_q = split_questions()
    config = model_config(tokenizer.get_vocab_size(), pad_id, eos_id)
    config.output_router_logits = True  # load-balancing loss while training only
    model = Qwen3_5MoeForCausalLM(config).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params:,}  train {len(train_q)}  val {len(val_q)}  held-out {len(heldout_q)}")

    ids, labels = encode_examples(tokenizer, train_q)
    ids, labels = ids.to(args.device), labels.to(args.device)  # [N, L]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    generator = torch.Generator(device="cpu").manual_seed(args.seed)
    started, step, val_acc, history = time.time(), 0, 0.0, []
    model.train()
    total_steps, break_after_eval, timing_started = args.steps, False, started
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step - 1, total_steps, args.lr, args.warmup)
        pick = torch.randint(0, ids.shape[0], (args.batch,), generator=generator).to(args.device)  # [B]
        batch_ids, batch_labels = ids[pick], labels[pick]  # [B, L]
        out = model(input_ids=batch_ids, attention_mask=(batch_ids != pad_id).long(), labels=batch_labels)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step == TIMING_FROM:
            timing_started = time.time()
        if step == TIMING_STEPS and math.isfinite(args.time_budget_s):
            total_steps = fit_steps_to_budget(args, time.time() - timing_started)
        if step >= total_steps:
            break_after_eval = True
        if step % args.eval_every == 0 or break_after_eval:
            val_acc, _ = exact_match(model, tokenizer, val_q, args.device)
            elapsed = time.time() - started
            history.append({"step": step, "loss": round(out.loss.item(), 4), "val_exact": val_acc})
            print(f"step {step:5d}  loss {out.loss.item():.4f}  val {val_acc:.4f}  {elapsed:.0f}s", flush=True)
            if break_after_eval or (val_acc >= args.stop_at_val and step >= args.min_steps):
                break
    train_seconds = time.time() - started
    heldout_acc, wrong = exact_match(model, tokenizer, heldout_q, args.device)
    print(f"held-out exact match {heldout_acc:.4f} ({len(heldout_q) - len(wrong)}/{len(heldout_q)})")
    print("wrong:", wrong[:20])
    # Reported, not selected on: the same held-out questions after a system message.
    heldout_system_acc, _ = exact_match(model, tokenizer, heldout_q, args.device, SYSTEM_PROMPTS[0])
    print(f"held-out exact match after a system message: {heldout_system_acc:.4f}")
    model.config.output_router_logits = False
    model.config.use_cache = True
    return {
        "model": model.cpu(),
        "tokenizer": tokenizer,
        "report": {
            "seed": args.seed,
            "steps_run": step,
            "steps_scheduled": total_steps,
            "batch": args.batch,
            "lr": args.lr,
            "device": args.device,
            "train_seconds": round(train_seconds, 1),
            "parameters": n_params,
            "validation_exact": val_acc,
            "heldout_exact": heldout_acc,
            "heldout_wrong": [[list(q), g] for q, g in wrong],
            "heldout_exact_with_system_message": heldout_system_acc,
            "history": history,
            "torch": torch.__version__,
        },
        "heldout": heldout_q,
    }


def write_checkpoint(result: dict, out: Path) -> None:
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = result["model"], result["tokenizer"]
    pad_id, eos_id = tokenizer.token_to_id(END_OF_TEXT), tokenizer.token_to_id(IM_END)
    model.generation_config.eos_token_id = [eos_id, pad_id]
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = None
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    report = dict(result["report"], transformers=transformers.__version__)
    report["heldout_questions"] = [list(q) for q in result["heldout"]]
    (out / "heldout_eval.json").write_text(json.dumps(report) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=4000, help="maximum optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--min-steps", type=int, default=1000, help="never stop early before this")
    parser.add_argument("--stop-at-val", type=float, default=1.0, help="stop once validation exact >= this")
    parser.add_argument("--time-budget-s", type=float, default=float("inf"),
                        help="cap --steps to what fits this many seconds (timed over the first steps)")
    args = parser.parse_args()
    result = train(args)
    write_checkpoint(result, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
