"""Shared helpers of the torch_exec tests: tiny random Qwen3 MoE models built and saved with transformers,
loaded back through our checkpoint loader, and drivers that run requests through TorchExecutor.

Shape legend: T tokens, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from adapters.checkpoint.loader import LoadedCheckpoint, load_checkpoint
from adapters.torch_exec.executor import TorchExecutor
from domain.budget import GpuBudget, PoolRequest, plan_pools
from domain.ports import SequenceWork, StepBatch
from domain.request import SamplingParams

# NOTE: tiny models on a shared 2-core box: one intra-op thread is ~30x faster than two contending
# OpenMP threads spinning at every barrier (measured: 7.2 s vs 0.2 s for the same 12 steps).
torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
PAGE_SIZE = 4

QWEN3_5_CONFIGS = {
    # 3 GDN + 1 attention like the real model; value heads share key heads (Nv = 2 Nk); partial rotary 0.25
    "hybrid_3to1": dict(hidden_size=64, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32),
    # alternating layers, one kv head, Nk = Nv, half rotary, top-3 of 6, conv kernel 3
    "alternating_mqa": dict(hidden_size=48, num_hidden_layers=4,
                            layer_types=["full_attention", "linear_attention"] * 2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                            linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3,
                            num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                            shared_expert_intermediate_size=16, rope_parameters={
                                "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # full rotary, more heads per kv head, many experts
    "wide_router": dict(hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                        num_attention_heads=4, num_key_value_heads=1, head_dim=8, linear_num_key_heads=1,
                        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16, rope_parameters={
                            "rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 1.0}),
}

QWEN3_CONFIGS = {
    "renormalised": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                         norm_topk_prob=True),
    "raw_topk_tied": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                          head_dim=8, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16,
                          norm_topk_prob=False, tie_word_embeddings=True),
}


def build_hf_model(arch: str, overrides: dict, seed: int = 0, init_range: float = 0.08):
    """A random fp32 transformers model; init scale raised so routing and logits are not near-uniform."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=96, initializer_range=init_range, max_position_embeddings=1024)
    if arch == "qwen3_5_moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**common, **overrides))
        # zero-centred (1 + w) norms start at exactly 1; perturb them so a wrong norm form shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):  # the GDN output norm is a plain w * x norm
                    p.normal_(1.0 if "linear_attn.norm" in name else 0.0, 0.1)
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, **overrides))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(1.0, 0.1)
    return model.float().eval()


def save_and_load(model, directory: Path) -> LoadedCheckpoint:
    model.save_pretrained(directory)
    return load_checkpoint(directory, progress=False)


def make_plan(ckpt: LoadedCheckpoint, expert_slots: int, kv_tokens: int = 1024, state_slots: int = 4):
    plan = plan_pools(ckpt.spec, GpuBudget(total_bytes=1 << 40),
                      PoolRequest(kv_tokens=kv_tokens, expert_slots=expert_slots, state_slots=state_slots,
                                  page_size=PAGE_SIZE))
    assert not hasattr(plan, "shortfall_bytes"), plan
    return plan


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """transformers' prefill logits [T, V], then `steps` greedy decode steps: (logits per step, tokens)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt], device=model.device), use_cache=True)
        prefill = out.logits[0]
        past, token = out.past_key_values, int(prefill[-1].argmax())
        logits, tokens = [], [token]
        for _ in range(steps):
            out = model(torch.tensor([[token]], device=model.device), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0, -1])
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
    return prefill, logits, tokens


@dataclass
class Sequence:
    """Client-side bookkeeping of one request driven through the executor by hand."""

    request_id: str
    prompt: list[int]
    pages: tuple[int, ...]
    state_slot: int
    params: SamplingParams = GREEDY
    computed: int = 0
    output: list[int] | None = None

    def __post_init__(self):
        self.output = []

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def next_work(self, chunk: int) -> SequenceWork:
        todo = self.tokens[self.computed:self.computed + chunk]
        done = self.computed + len(todo) == len(self.tokens)
        return SequenceWork(self.request_id, tuple(todo), self.computed, self.pages, self.state_slot, done,
                            self.params, len(self.output))


def run_requests(executor: TorchExecutor, seqs: list[Sequence], new_tokens: int, chunk: int = 5,
                 record: dict[str, list[torch.Tensor]] | None = None) -> None:
    """Continuous batching by hand: every step carries each unfinished sequence's next prefill chunk or
    its decode token, prefills first, until every sequence holds `new_tokens` outputs. With `record`,
    the sampled rows' logits are kept per request (and tokens come from executor.sampler on them)."""
    while any(len(s.output) < new_tokens for s in seqs):
        live = [s for s in seqs if len(s.output) < new_tokens]
        works = [s.next_work(chunk) for s in live]
        order = sorted(range(len(works)), key=lambda i: len(works[i].token_ids) == 1)
        batch = StepBatch(tuple(works[i] for i in order))
        if record is None:
            sampled = executor.execute(batch)
        else:
            logits = executor.compute_logits(batch)
            sampled = {}
            for w in batch.works:
                if w.sample:
                    record.setdefault(w.request_id, []).append(logits[w.request_id][0])
                    sampled[w.request_id] = executor.sampler.sample(w.request_id, logits[w.request_id][0],
                                                                    w.sampling, w.output_index)
        for s, w in zip(live, works, strict=True):
            s.computed += len(w.token_ids)
            if w.sample:
                s.output.append(sampled[s.request_id].token_id)
        executor.check_valid()


def pages_for(index: int, tokens: int) -> tuple[int, ...]:
    """Disjoint, deliberately non-contiguous pages for sequence `index` (interleaved across sequences)."""
    count = -(-tokens // PAGE_SIZE)
    return tuple(index + 7 * i for i in range(count))


DECODE_STEPS = 32
REL_TOL = 1e-4  # of the logit scale (max |logit| of the reference)


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= REL_TOL * scale, f"{what}: max |diff| {err:.3g} > {REL_TOL} x logit scale {scale:.3g}"


def check_parity(arch: str, overrides: dict, tmp_path, prompt_len: int, chunk: int) -> None:
    model = build_hf_model(arch, overrides)
    ckpt = save_and_load(model, tmp_path)
    assert ckpt.spec.architecture == arch
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=gen).tolist()
    ref_prefill, ref_decode, ref_tokens = hf_greedy(model, prompt, DECODE_STEPS)

    # a handful of slots: fewer than the experts one layer routes to, so lookups split and evict
    executor = TorchExecutor(ckpt, make_plan(ckpt, expert_slots=ckpt.spec.top_k + 1), "cpu", torch.float32)
    pages = pages_for(1, prompt_len + DECODE_STEPS + 1)
    prefill = []
    for start in range(0, prompt_len, chunk):
        part = tuple(prompt[start:start + chunk])
        done = start + len(part) == prompt_len
        work = SequenceWork("r", part, start, pages, 2, done, GREEDY, 0)
        prefill.append(executor.compute_logits(StepBatch((work,)), all_positions=True)["r"])
    assert_close(torch.cat(prefill), ref_prefill, "prefill logits")

    tokens = [executor.sampler.sample("r", prefill[-1][-1], GREEDY, 0).token_id]
    position = prompt_len
    for step in range(DECODE_STEPS):
        work = SequenceWork("r", (tokens[-1],), position, pages, 2, True, GREEDY, step + 1)
        logits = executor.compute_logits(StepBatch((work,)))["r"][0]
        assert_close(logits, ref_decode[step], f"decode step {step}")
        tokens.append(executor.sampler.sample("r", logits, GREEDY, step + 1).token_id)
        position += 1
    assert tokens == ref_tokens
    assert executor.expert_misses > 0 and executor.experts.residency.evictions > 0
    executor.check_valid()


def packed_expert_rows(layout, count: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [count, layout.row_bytes]: random experts (gate, up [I, H], down [H, I], N(0, 0.2)) quantized to
    layout.fmt and packed as the host bank holds them."""
    from adapters.checkpoint.quantize import quantize

    hidden, inter = layout.hidden, layout.intermediate
    rows = torch.empty((count, layout.row_bytes), dtype=torch.uint8)
    for r in range(count):
        mats = [quantize(torch.randn(*shape, generator=gen) * 0.2, layout.fmt)
                for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
        layout.pack(*mats, out=rows[r])
    return rows


def random_fp8_bank(hidden: int, inter: int, layers: int, experts: int, seed: int = 0):
    """A HostExpertBank of layers x experts random block-FP8 experts (packed_expert_rows, generator seeded with
    seed), pinned where CUDA runs (the gather kernel reads it zero-copy)."""
    from adapters.checkpoint.expert_layout import ExpertLayout
    from adapters.checkpoint.host_bank import HostExpertBank
    from domain.model_spec import WeightFormat

    layout = ExpertLayout(WeightFormat.FP8_BLOCK, hidden, inter)
    rows = packed_expert_rows(layout, layers * experts, torch.Generator().manual_seed(seed))
    if torch.cuda.is_available():
        rows = rows.pin_memory()
    return HostExpertBank(layout, layers, experts, rows)
