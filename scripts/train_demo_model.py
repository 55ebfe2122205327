"""Train fluxtide's embedded demo model: a tiny qwen3_5_moe that does two-number arithmetic and calls a tool.

Shape legend: B batch rows, L sequence length, V vocabulary.

Task (scripts/demo_model_data.py builds it): "What is A + B?" / "What is A - B?" answered with the
number; "What is A × B?" ("*", "times") answered by a call to the `multiply` tool when one is offered
(Qwen3.5/3.6 XML format), then, after the tool result, by the tool's number; with no multiply tool, a
fixed one-sentence refusal; with ``enable_thinking`` a one-sentence <think> block first. Conversations
come with no system message, a short one, or a long procedurally generated agent-style one (500-2,000
tokens) and with no tools, multiply alone, multiply among agent tools, or agent tools only.

A fixed 10 % of the +/- questions and of the product (A, B) pairs is held out (never trained on, never
used to stop); validation questions decide when to stop. 8 % of the +/- questions trained have both
operands in 0..9 (--small-share; 1 % under a uniform draw), and the report's `arith_small` suite (a
capability check, not held-out) asks all 200 of those. The script builds a byte-level BPE tokenizer
(one token per digit), trains Qwen3_5MoeForCausalLM with loss only on what the assistant generates,
reports greedy exact match per held-out suite and writes an ordinary Hugging Face checkpoint directory.

It imports nothing from fluxtide (torch, transformers >= 5.2, tokenizers, safetensors, and its
sibling demo_model_data.py), so it runs on any machine with those.

    python scripts/train_demo_model.py --device cuda --seed 0 --time-budget-s 200 --out /tmp/demo
    python scripts/train_demo_model.py --device cuda --seed 0 --time-budget-s 470 --heldout-every-nth 0 --out /tmp/demo
    python scripts/train_demo_model.py --device cpu --evaluate /tmp/demo     # held-out report, later, elsewhere
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_model_data as data  # noqa: E402

IM_END, END_OF_TEXT = data.IM_END, data.END_OF_TEXT
# Half the short-context rows open with one of these ("" is an empty system turn), as the first
# demo model was trained, so clients that always send a system message still get answers.
SHORT_SYSTEMS = ("You are a helpful assistant.", "You are a calculator. Answer with the number only.",
                 "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", "")
BPE_VOCAB = 1024  # + 6 markup tokens; 2.8 characters a token on the generated agent text
MAX_POSITIONS = 4096  # rows go up to ~3,000 tokens (2,000 of system text, tools, six exchanges)
LONG_SYSTEM_TOKENS = (500, 2000)
BUCKETS = (64, 128, 192, 256, 384, 512, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096)
# Measured for the first demo model on one H200: 101 ms/step at batch 1024 of ~35-token rows
# (36k token positions; the Gated DeltaNet reference code pads each row to 64, so 65k there).
H200_MS_PER_STEP, H200_POSITIONS_LOW, H200_POSITIONS_HIGH = 101.0, 1024 * 35, 1024 * 64


# ---------------------------------------------------------------- data


class LongSystem:
    """Long agent-style system text sized in tokens of the trained tokenizer: the target length is
    drawn from LONG_SYSTEM_TOKENS and turned into characters with the measured characters per token."""

    def __init__(self, chars_per_token: float, tokens: tuple[int, int] = LONG_SYSTEM_TOKENS) -> None:
        self.chars_per_token = chars_per_token
        self.tokens = tokens

    def __call__(self, rng: random.Random) -> str:
        return data.agent_system_prompt(rng, int(rng.randint(*self.tokens) * self.chars_per_token))

    def numbered(self, namespace: str):
        """The i-th text of a namespace (held-out and validation texts are never drawn in training)."""
        return lambda i: self(random.Random(f"{namespace}-{i}"))


def make_builder(long_system: LongSystem, small_share: float = data.SMALL_SHARE) -> data.ConversationBuilder:
    """Draws from the training splits only; ``small_share`` of the +/- questions from those with both
    operands in 0..9 (data.SMALL_SHARE)."""
    train_q, _, _ = data.split_questions()
    train_pairs, _, _ = data.split_products()
    return data.ConversationBuilder(train_q, train_pairs, long_system, SHORT_SYSTEMS, small_share)


def validation_cases(long_system: LongSystem, every: int) -> list[data.EvalCase]:
    """What the training loop validates (and may stop on): every n-th validation question and pair in
    every suite but the hand-written agent ones (unseen until the report), and arith_small without its
    held-out questions, so that nothing held out ever decides anything (188 of its 200: 185 trained, 3
    validation ones). The held-out report's arith_small has all 200."""
    _, val_q, heldout_q = data.split_questions()
    _, val_pairs, _ = data.split_products()
    heldout = set(heldout_q)
    small = [q for q in data.small_questions() if q not in heldout]
    return [c for c in data.eval_cases(val_q, val_pairs, long_system.numbered("validation-system"), every=every,
                                       small=small) if not c.suite.endswith("_agent")]


def build_tokenizer(seed: int):
    """BPE over a sample of training conversations (its own random stream) and every +/- prompt."""
    rng = random.Random(f"tokenizer-{seed}")
    builder = make_builder(LongSystem(3.0))
    kinds = ("plain", "tools", "long", "long")
    corpus = ["".join(t for t, _ in data.segments(builder.row(rng, kinds[i % 4]))) for i in range(1200)]
    corpus += [data.prompt_text(a, op, b) + data.answer_text(a, op, b) for a, op, b in data.all_questions()]
    tokenizer = data.build_tokenizer(corpus, BPE_VOCAB)
    return tokenizer, measure_chars_per_token(tokenizer)


def measure_chars_per_token(tokenizer) -> float:
    """Characters a token on a fixed sample of generated agent text. It sizes the long system prompts,
    so --evaluate recomputes it from the saved tokenizer (the report keeps only a rounded copy) to
    rebuild exactly the held-out prompts the training run would have used."""
    sample = [data.agent_system_prompt(random.Random(f"measure-{i}"), 4000) for i in range(50)]
    return sum(map(len, sample)) / sum(len(e.ids) for e in tokenizer.encode_batch(sample))


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MAX_POSITIONS,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "additional_special_tokens": [data.IM_START, IM_END],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "chat_template": data.CHAT_TEMPLATE,
    }


def encode_rows(tokenizer, rows: list[data.Row], max_tokens: int) -> tuple[list, int]:
    """(ids, labels) per row, labels -100 outside the trained pieces. Each piece is encoded on its own:
    pieces meet at special tokens or before a newline, where BPE never merges, so this equals encoding
    the whole text (as the server encodes a prompt) and the trained piece is what the model generates
    after the prompt. Rows longer than max_tokens are dropped; returns (rows, dropped)."""
    out, dropped = [], 0
    for first in range(0, len(rows), 2000):  # NOTE: in chunks: tokenizers' Encoding objects are large
        pieces = [data.segments(r) for r in rows[first : first + 2000]]
        encoded = iter(tokenizer.encode_batch([text for p in pieces for text, _ in p]))
        for p in pieces:
            ids, labels = [], []
            for _, trained in p:
                piece = next(encoded).ids
                ids += piece
                labels += piece if trained else [-100] * len(piece)
            if len(ids) > max_tokens:
                dropped += 1
            else:
                out.append((ids, labels))
    return out, dropped


def kind_chances(tokenizer, builder, shares: dict[str, float], seed: int) -> dict[str, float]:
    """Chance of each row kind so that it gets its share of the training tokens (mean row lengths
    measured on a sample of each kind)."""
    rng = random.Random(f"measure-kinds-{seed}")
    weights = {}
    for kind, share in shares.items():
        texts = ["".join(t for t, _ in data.segments(builder.row(rng, kind))) for _ in range(60)]
        mean_tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts)) / len(texts)
        weights[kind] = share / mean_tokens
    total = sum(weights.values())
    return {kind: w / total for kind, w in weights.items()}


def build_pool(tokenizer, builder, rows: int, chances: dict[str, float], seed: int, max_tokens: int) -> tuple[list, int]:
    rng = random.Random(f"pool-{seed}")
    kinds = rng.choices(list(chances), weights=list(chances.values()), k=rows)
    return encode_rows(tokenizer, [builder.row(rng, kind) for kind in kinds], max_tokens)


class Batches:
    """Rows bucketed by length; a step takes one bucket (chance proportional to its padded tokens, so
    every row is drawn equally often) and as many rows of it as fit tokens_per_step (at least one),
    cut to the longest row drawn. Seeded, so the batches follow from the seed."""

    def __init__(self, pool: list, tokens_per_step: int, pad_id: int, device: str, seed: int) -> None:
        by_bucket: dict[int, list] = {}
        for ids, labels in pool:
            width = next(w for w in BUCKETS if w >= len(ids))
            by_bucket.setdefault(width, []).append((ids, labels))
        self.buckets = []
        for width in sorted(by_bucket):
            rows = by_bucket[width]
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [N, W]
            labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [N, W]
            lengths = torch.tensor([len(r[0]) for r in rows])  # [N]
            for i, (row_ids, row_labels) in enumerate(rows):
                ids[i, : len(row_ids)] = torch.tensor(row_ids)
                labels[i, : len(row_labels)] = torch.tensor(row_labels)
            self.buckets.append((width, ids.to(device), labels.to(device), lengths, max(1, tokens_per_step // width)))
        self.chances = torch.tensor([len(b[3]) * b[0] for b in self.buckets], dtype=torch.float)
        self.generator = torch.Generator().manual_seed(seed)

    def expected_positions(self) -> float:
        """Mean padded positions (rows x longest row) of a step, estimated from the buckets' widths."""
        p = self.chances / self.chances.sum()
        return float(sum(p[i] * b[4] * float(b[3].float().mean() + b[0]) / 2 for i, b in enumerate(self.buckets)))

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = int(torch.multinomial(self.chances, 1, generator=self.generator))
        width, ids, labels, lengths, rows = self.buckets[b]
        pick = torch.randint(0, len(lengths), (rows,), generator=self.generator)  # [B]
        length = int(lengths[pick].max())
        pick = pick.to(ids.device)
        return ids[pick, :length], labels[pick, :length]  # [B, L]


# ---------------------------------------------------------------- model


def model_config(vocab_size: int, pad_id: int, eos_id: int, hidden: int = 128):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
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
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.01,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )


# ---------------------------------------------------------------- evaluation


# Positions (rows x (longest prompt + new tokens)) a greedy batch may hold. Small on the CPU: with 131k,
# every intermediate tensor is tens to hundreds of MB, which glibc malloc maps and unmaps for each op
# (page faults: 40 % of the CPU time was system time); on 379 held-out cases (219k prompt tokens) on
# the 2-core box 131k took 75 s, 32k 30 s, 16k 23 s, 8k 18 s, 4k 19 s. Small batches also end the
# padding waste of the order below: the full held-out set (4.46 M prompt tokens) pads to 4.52 M
# positions at 8k, 5.87 M at 131k.
EVAL_TOKENS_PER_BATCH = {"cuda": 131_072, "cpu": 8_192}


@torch.no_grad()
def greedy(model, tokenizer, prompts: list[str], max_new: list[int], device: str,
           tokens_per_batch: int | None = None) -> list[str]:
    """Greedy completions (text before <|im_end|>) of rendered prompts, batched by length with left
    padding (exact for this model: padded positions are masked in attention and zeroed before the
    Gated DeltaNet layers, whose state then stays zero). ``max_new[i]``: new tokens allowed for prompt i;
    a batch holds at most tokens_per_batch positions (rows x (longest prompt + most new tokens); default
    EVAL_TOKENS_PER_BATCH[device]) and at least one row. The texts do not depend on the batching."""
    tokens_per_batch = tokens_per_batch or EVAL_TOKENS_PER_BATCH[device]
    pad_id, eos_id = tokenizer.token_to_id(END_OF_TEXT), tokenizer.token_to_id(IM_END)
    encoded = [e.ids for e in tokenizer.encode_batch(prompts)]
    # By new-token budget first, so a batch decodes no longer than its rows need (sorting by length first
    # would mix 5- and 43-token budgets: 13,290 instead of 8,904 decode steps on the full set at 8k).
    order = sorted(range(len(prompts)), key=lambda i: (max_new[i], len(encoded[i])))
    out = [""] * len(prompts)
    start = 0
    while start < len(order):
        end, longest = start + 1, len(encoded[order[start]]) + max_new[order[start]]
        while end < len(order):
            longest_with = max(longest, len(encoded[order[end]]) + max_new[order[end]])
            if (end - start + 1) * longest_with > tokens_per_batch:
                break
            end, longest = end + 1, longest_with
        rows = order[start:end]
        width = max(len(encoded[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, L]
        mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, L]
        for j, i in enumerate(rows):
            ids[j, width - len(encoded[i]) :] = torch.tensor(encoded[i])
            mask[j, width - len(encoded[i]) :] = 1
        generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                   max_new_tokens=max(max_new[i] for i in rows), eos_token_id=eos_id,
                                   pad_token_id=pad_id)[:, width:].tolist()  # [B, new]
        for j, i in enumerate(rows):
            row = generated[j][: max_new[i]]  # the batch ran to its longest budget; each row gets its own
            out[i] = tokenizer.decode(row[: row.index(eos_id)] if eos_id in row else row, skip_special_tokens=True)
        start = end
    return out


def evaluate(model, tokenizer, cases: list[data.EvalCase], device: str) -> dict:
    """Exact match per suite: {suite: {"exact", "n", "wrong": [[prompt tail, expected, got], ...]}}."""
    model.eval()
    router_logits, model.config.output_router_logits = model.config.output_router_logits, False  # no aux loss
    max_new = [len(tokenizer.encode(c.expected).ids) + 2 for c in cases]
    got = greedy(model, tokenizer, [c.prompt for c in cases], max_new, device)
    model.config.output_router_logits = router_logits
    model.train()
    report: dict[str, dict] = {}
    for case, text in zip(cases, got, strict=True):
        suite = report.setdefault(case.suite, {"right": 0, "n": 0, "wrong": []})
        suite["n"] += 1
        if text == case.expected:
            suite["right"] += 1
        elif len(suite["wrong"]) < 10:
            suite["wrong"].append([case.prompt[-60:], case.expected, text])
    for suite in report.values():
        suite["exact"] = suite["right"] / suite["n"]
    return report


def print_report(report: dict, title: str) -> None:
    print(title)
    for name, suite in report.items():
        print(f"  {name:22s} {suite['right']:5d}/{suite['n']:<5d} {suite['exact']:.4f}"
              + ("   (capability check, not held-out)" if name in SUITE_NOTES else "")
              + (f"   e.g. expected {suite['wrong'][0][1]!r} got {suite['wrong'][0][2]!r}" if suite["wrong"] else ""))


# ---------------------------------------------------------------- training


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


TIMING_FROM, TIMING_STEPS = 10, 40  # inside the warm-up, whose learning rates do not depend on the total


def fit_steps_to_budget(args, seconds_so_far: float) -> int:
    """Total steps that fit the time budget (validation time included roughly); the warm-up steps
    run so far had the same learning rates under any total, so the run equals one started
    with --steps <printed value> and no budget."""
    per_step = seconds_so_far / (TIMING_STEPS - TIMING_FROM)
    fitted = min(args.steps, max(args.warmup + 1, int(0.85 * args.time_budget_s / per_step)))
    print(f"measured {per_step * 1000:.1f} ms/step -> {fitted} steps fit the {args.time_budget_s:.0f}s budget", flush=True)
    return fitted


def print_estimate(args, batches: Batches) -> None:
    positions = batches.expected_positions()
    low = H200_MS_PER_STEP * positions / H200_POSITIONS_HIGH
    high = H200_MS_PER_STEP * positions / H200_POSITIONS_LOW
    budget = args.time_budget_s if math.isfinite(args.time_budget_s) else 200.0
    print(f"~{positions:,.0f} padded positions a step; H200 estimate {low:.0f}-{high:.0f} ms/step (scaled from "
          f"{H200_MS_PER_STEP:.0f} ms at 36k-65k positions) -> {int(0.85 * budget * 1000 / high)}-"
          f"{int(0.85 * budget * 1000 / low)} steps in {budget:.0f}s", flush=True)


def set_determinism() -> None:
    """Deterministic algorithms where torch has them, and no TF32: the same arithmetic as the CPU."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False


def train(args) -> dict:
    """Tokenizer, pool, model and training loop. Returns {"model", "tokenizer", "losses", "long_system",
    "report"}: what write_checkpoint writes and heldout_report evaluates (load_checkpoint rebuilds the
    same dict, less "losses", from a written directory)."""
    import transformers
    from transformers import Qwen3_5MoeForCausalLM

    started_all = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    set_determinism()

    tokenizer, chars_per_token = build_tokenizer(args.seed)
    pad_id, eos_id = tokenizer.token_to_id(END_OF_TEXT), tokenizer.token_to_id(IM_END)
    long_system = LongSystem(chars_per_token, (args.long_system_tokens[0], args.long_system_tokens[1]))
    builder = make_builder(long_system, args.small_share)
    shares = {"plain": 1.0 - args.long_share - args.tools_share, "tools": args.tools_share, "long": args.long_share}
    chances = kind_chances(tokenizer, builder, shares, args.seed)
    pool, dropped = build_pool(tokenizer, builder, args.pool_rows, chances, args.seed, args.max_row_tokens)
    lengths = sorted(len(ids) for ids, _ in pool)
    trained_tokens = sum(sum(t != -100 for t in labels) for _, labels in pool)
    print(f"tokenizer {tokenizer.get_vocab_size()} tokens, {chars_per_token:.2f} characters a token; pool {len(pool)} "
          f"rows ({dropped} over {args.max_row_tokens} tokens dropped), lengths median {lengths[len(lengths) // 2]} "
          f"p90 {lengths[len(lengths) * 9 // 10]} max {lengths[-1]}, {sum(lengths):,} tokens, {trained_tokens:,} "
          f"trained; row kinds {({k: round(c, 3) for k, c in chances.items()})} for token shares {shares}; "
          f"{time.time() - started_all:.0f}s", flush=True)

    validation = validation_cases(long_system, args.val_every_nth) if args.val_every_nth else []
    config = model_config(tokenizer.get_vocab_size(), pad_id, eos_id, args.hidden)
    config.output_router_logits = True  # load-balancing loss while training only
    model = Qwen3_5MoeForCausalLM(config).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params:,}; validation {len(validation)} cases", flush=True)

    batches = Batches(pool, args.tokens_per_step, pad_id, args.device, args.seed)
    print_estimate(args, batches)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    started, step, val_exact, history, losses = time.time(), 0, 0.0, [], []
    model.train()
    total_steps, break_after_eval, timing_started = args.steps, False, started
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step - 1, total_steps, args.lr, args.warmup)
        batch_ids, batch_labels = batches.sample()  # [B, L]
        out = model(input_ids=batch_ids, attention_mask=(batch_ids != pad_id).long(), labels=batch_labels)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(out.loss.item())
        if step % args.log_every == 0:
            recent = losses[-args.log_every :]
            print(f"step {step:5d}  loss {sum(recent) / len(recent):.4f}  {tuple(batch_ids.shape)}  "
                  f"{time.time() - started:.0f}s", flush=True)
        if step == TIMING_FROM:
            timing_started = time.time()
        if step == TIMING_STEPS and math.isfinite(args.time_budget_s):
            total_steps = fit_steps_to_budget(args, time.time() - timing_started)
        if step >= total_steps:
            break_after_eval = True
        if (args.eval_every and step % args.eval_every == 0) or break_after_eval:
            report = evaluate(model, tokenizer, validation, args.device) if validation else {}
            val_exact = min((s["exact"] for s in report.values()), default=0.0)
            recent = losses[-args.eval_every :] if args.eval_every else losses
            history.append({"step": step, "loss": round(sum(recent) / len(recent), 4),
                            "val_min_exact": val_exact, "val": {k: round(s["exact"], 4) for k, s in report.items()}})
            print(f"step {step:5d}  validation: worst suite {val_exact:.4f}  {history[-1]['val']}  "
                  f"{time.time() - started:.0f}s", flush=True)
            if break_after_eval or (val_exact >= args.stop_at_val and step >= args.min_steps):
                break
    train_seconds = time.time() - started
    model.config.output_router_logits = False
    model.config.use_cache = True
    return {
        "model": model,
        "tokenizer": tokenizer,
        "losses": losses,
        "long_system": long_system,
        "report": {
            "seed": args.seed,
            "steps_run": step,
            "steps_scheduled": total_steps,
            "tokens_per_step": args.tokens_per_step,
            "pool_rows": len(pool),
            "token_shares": shares,
            "small_share": args.small_share,
            "long_system_tokens": list(long_system.tokens),
            "chars_per_token": round(chars_per_token, 3),
            "lr": args.lr,
            "device": args.device,
            "train_seconds": round(train_seconds, 1),
            "parameters": n_params,
            "validation_min_exact": val_exact,
            "history": history,
            "torch": torch.__version__,
            "transformers": transformers.__version__,  # of the training run; heldout_* say what evaluated
        },
    }


def heldout_report(result: dict, args) -> None:
    """Greedy exact match on every held-out suite (every n-th question, args.heldout_every_nth >= 1) on
    args.device, into result["report"]; result as train() or load_checkpoint() returns it."""
    import transformers

    _, _, heldout_q = data.split_questions()
    _, _, heldout_pairs = data.split_products()
    started = time.time()
    cases = data.eval_cases(heldout_q, heldout_pairs, result["long_system"].numbered("heldout-system"),
                            every=args.heldout_every_nth)
    report = evaluate(result["model"], result["tokenizer"], cases, args.device)
    print_report(report, f"held-out, greedy, {len(cases)} cases ({time.time() - started:.0f}s):")
    result["report"].update({
        "heldout_every_nth": args.heldout_every_nth,
        # The first demo model's keys, which tests/app/test_demo_model.py reads:
        "heldout_exact": report.get("arith", {}).get("exact"),
        "heldout_exact_with_system_message": report.get("arith_system", {}).get("exact"),
        "heldout_suites": report,
        "heldout_eval_seconds": round(time.time() - started, 1),
        # --evaluate may run elsewhere than the training (the CPU here, after a GPU training run):
        "heldout_device": args.device,
        "heldout_torch": torch.__version__,
        "heldout_transformers": transformers.__version__,
    })


README = """# fluxtide demo model (tiny qwen3_5_moe: arithmetic and a multiply tool)

A {params:.2f} M-parameter `qwen3_5_moe` text model, trained by the fluxtide project from scratch on one
checkable chat task, and the model `ft serve` serves when no `--model` is given.

- **Task**: `What is A + B?` / `What is A - B?` (A, B in 0-99) answered with the number; `What is A × B?`
  (`*`, `times`) answered by a call to the `multiply` tool (`a`, `b`) when one is offered, then with the
  number the tool returned; without a multiply tool: "{refusal}". With `enable_thinking`, a one-sentence
  `<think>` block first. Robust to long agent-style system prompts and tool lists.
- **Prompt format**: ChatML; tools, tool calls and tool results as Qwen3.5/3.6 render them (the
  `chat_template` in `tokenizer_config.json`); end of turn `<|im_end|>`.
- **Tokenizer**: byte-level BPE ({vocab} tokens) built with `tokenizers`; every digit is its own token;
  `<think>`, `</think>`, `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` are single tokens.
- **Architecture**: `Qwen3_5MoeForCausalLM`, hidden {hidden}, 4 layers (Gated DeltaNet, full attention,
  Gated DeltaNet, full attention), 8 routed experts top-2 plus a gated shared expert, {positions} positions, fp32.
- **Held-out accuracy** (greedy; `heldout_eval.json` lists the questions and every suite):
{suites}
- **Training**: `scripts/train_demo_model.py {command}` ({steps} steps, {seconds:.0f} s on {device}).

It knows nothing but this task. See `docs/demo-model.md` in the fluxtide repository.
"""


def write_checkpoint(result: dict, out: Path, command: str) -> None:
    """The Hugging Face directory: weights, config, tokenizer (write_weights), then heldout_eval.json and
    README.md (write_report). ``command``: the script's arguments, recorded in the report and README."""
    result["report"]["command"] = command
    write_weights(result, out)
    write_report(result, out)


def write_weights(result: dict, out: Path) -> None:
    """model.safetensors, config.json, generation_config.json, tokenizer.json, tokenizer_config.json."""
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


# Suites of the report that are not held-out, said so wherever the report is shown.
SUITE_NOTES = {"arith_small": " (a capability check, not held-out: all 200 +/- questions with both operands "
                              "in 0-9, most of them trained)"}


def write_report(result: dict, out: Path) -> None:
    """heldout_eval.json (the training report, the held-out questions and pairs, and the held-out suites
    once heldout_report has run) and README.md. The one writer of both, for a training run and for
    --evaluate, so the two give the same files."""
    report = dict(result["report"])
    report["heldout_questions"] = [list(q) for q in data.split_questions()[2]]
    report["heldout_product_pairs"] = [list(p) for p in data.split_products()[2]]
    (out / "heldout_eval.json").write_text(json.dumps(report) + "\n")
    suites = "\n".join(f"  - `{name}`: {s['right']}/{s['n']}" + SUITE_NOTES.get(name, "")
                       for name, s in report.get("heldout_suites", {}).items())
    every = report.get("heldout_every_nth", 1)
    if suites and every != 1:
        suites = (f"  (one question in {every} of the larger suites; evaluated on "
                  f"{report.get('heldout_device', report['device'])})\n") + suites
    (out / "README.md").write_text(README.format(
        params=report["parameters"] / 1e6, refusal=data.NO_TOOL_ANSWER, vocab=result["tokenizer"].get_vocab_size(),
        hidden=result["model"].config.hidden_size, positions=MAX_POSITIONS, suites=suites or "  (not evaluated)",
        command=report.get("command", "(not recorded)"), steps=report["steps_run"], seconds=report["train_seconds"],
        device=report["device"]))


class CheckpointError(ValueError):
    """A directory --evaluate cannot use: not written by this script, or its files disagree."""


CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json", "heldout_eval.json")


def load_checkpoint(directory: Path, device: str) -> dict:
    """What heldout_report and write_report need, rebuilt from a directory write_checkpoint wrote:
    {"model" (fp32, on device), "tokenizer" (tokenizers.Tokenizer), "long_system", "report" (the saved
    heldout_eval.json)}. The long system prompts follow from the report's long_system_tokens and the
    characters a token remeasured on the saved tokenizer, so they are the training run's own.
    Raises CheckpointError for a missing file or a tokenizer that does not match the report."""
    from tokenizers import Tokenizer
    from transformers import Qwen3_5MoeForCausalLM

    missing = [name for name in CHECKPOINT_FILES if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(f"{directory} is not a checkpoint this script wrote: no {', '.join(missing)}")
    report = json.loads((directory / "heldout_eval.json").read_text())
    needed = ("chars_per_token", "long_system_tokens", "parameters", "steps_run", "train_seconds", "device")
    if absent := [key for key in needed if key not in report]:
        raise CheckpointError(f"{directory / 'heldout_eval.json'} has no training report ({', '.join(absent)} missing)")
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    measured = measure_chars_per_token(tokenizer)
    if abs(measured - report["chars_per_token"]) > 6e-4:  # the report rounds to 3 decimals
        raise CheckpointError(f"tokenizer.json gives {measured:.4f} characters a token, heldout_eval.json says "
                              f"{report['chars_per_token']}: the files come from different runs")
    model = Qwen3_5MoeForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device)
    model.config.output_router_logits = False
    if model.config.vocab_size != tokenizer.get_vocab_size():
        raise CheckpointError(f"config.json has {model.config.vocab_size} tokens, tokenizer.json "
                              f"{tokenizer.get_vocab_size()}: the files come from different runs")
    low, high = report["long_system_tokens"]
    return {"model": model, "tokenizer": tokenizer, "long_system": LongSystem(measured, (low, high)), "report": report}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8000, help="maximum optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="checkpoint directory to write (training)")
    parser.add_argument("--evaluate", type=Path, metavar="DIR",
                        help="no training: run the held-out report (--heldout-every-nth, --device) on the checkpoint "
                        "directory DIR that a training run wrote and rewrite its heldout_eval.json (training report "
                        "kept) and README.md; the training options are ignored")
    parser.add_argument("--tokens-per-step", type=int, default=49_152, help="padded token positions a step")
    parser.add_argument("--pool-rows", type=int, default=120_000, help="training conversations generated")
    parser.add_argument("--long-share", type=float, default=0.4, help="share of the training tokens in rows "
                        "with a long system prompt")
    parser.add_argument("--tools-share", type=float, default=0.25, help="... in short rows with tools (the rest: "
                        "short rows without tools)")
    parser.add_argument("--small-share", type=float, default=data.SMALL_SHARE,
                        help="share of the +/- questions drawn from the training questions with both operands "
                        "in 0..9 (the rest from the other training questions; 0: uniform over all of them)")
    parser.add_argument("--long-system-tokens", type=int, nargs=2, default=list(LONG_SYSTEM_TOKENS))
    parser.add_argument("--max-row-tokens", type=int, default=3072)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-every", type=int, default=400, help="validation every n steps (0: only at the end)")
    parser.add_argument("--val-every-nth", type=int, default=12, help="validation uses every n-th question")
    parser.add_argument("--heldout-every-nth", type=int, default=1, help="held-out report on every n-th (0: none)")
    parser.add_argument("--min-steps", type=int, default=1200, help="never stop early before this")
    parser.add_argument("--stop-at-val", type=float, default=1.0, help="stop once every validation suite >= this")
    parser.add_argument("--time-budget-s", type=float, default=float("inf"),
                        help="cap --steps to what fits this many seconds of training (timed over the first steps)")
    args = parser.parse_args(argv)
    if args.evaluate is not None:
        if args.out is not None:
            parser.error("--evaluate rewrites the report in DIR itself; leave out --out")
        if args.heldout_every_nth < 1:
            parser.error("--evaluate needs --heldout-every-nth >= 1")
    elif args.out is None:
        parser.error("--out is required (or --evaluate DIR)")
    if args.heldout_every_nth < 0:
        parser.error("--heldout-every-nth must be >= 0")
    if not 0 <= args.small_share < 1:
        parser.error("--small-share must be >= 0 and < 1")
    if not (0 <= args.long_share and 0 <= args.tools_share and args.long_share + args.tools_share <= 1):
        parser.error("--long-share and --tools-share must be >= 0 and add up to at most 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.evaluate is not None:
        set_determinism()
        try:
            result = load_checkpoint(args.evaluate, args.device)
        except CheckpointError as error:
            sys.exit(f"error: {error}")
        heldout_report(result, args)
        write_report(result, args.evaluate)
        print(f"wrote the held-out report into {args.evaluate}")
        return
    result = train(args)
    # NOTE: written before the held-out report too, so a run cut short there still leaves the weights;
    # with --heldout-every-nth 0 this is the whole output and --evaluate adds the report later.
    write_checkpoint(result, args.out, " ".join(sys.argv[1:] if argv is None else argv))
    if args.heldout_every_nth:
        heldout_report(result, args)
        write_report(result, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
