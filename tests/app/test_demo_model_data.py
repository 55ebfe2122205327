"""The demo model's training data (scripts/demo_model_data.py, scripts/train_demo_model.py) against the
server's own pieces: the chat template renders through adapters' ChatTemplate (and transformers) exactly
as the script's Python renderer, every trained context is the prompt the server would render for that
request, every trained answer parses with the server's reasoning and qwen3_xml parsers into what the
client sends back, and that message renders back to the trained text. Plus the splits, the tokenizer,
the long system prompts, and a few CPU training steps whose loss falls."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest

from adapters.checkpoint.chat_template import ChatTemplate
from app.api.agent import OutputParser, arguments_object, split
from app.reasoning import ThinkParser, prompt_opens_reasoning
from app.tool_parsers import TOOL_PARSERS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import demo_model_data as data  # noqa: E402

torch = pytest.importorskip("torch")
import train_demo_model as train  # noqa: E402

# The first demo model's template (plain ChatML): what every no-tools, no-thinking prompt must still be.
FIRST_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = message['content'] | map(attribute='text') | join('') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QUESTION = re.compile(r"^What is (\d+) (\+|-|×|\*|times) (\d+)\?$")


@pytest.fixture(scope="module")
def template():
    return ChatTemplate(data.CHAT_TEMPLATE, {"eos_token": data.IM_END})


@pytest.fixture(scope="module")
def tokenizer():
    return train.build_tokenizer(0)


def rows(n: int, seed: int = 0, long_tokens=(60, 200)) -> list[data.Row]:
    builder = train.make_builder(train.LongSystem(2.8, long_tokens))
    rng = random.Random(seed)
    return [builder.row(rng, data.ConversationBuilder.KINDS[i % 3]) for i in range(n)]


def trained_turns(row: data.Row):
    """(prompt text, trained text, index of the assistant message or None for a forced-close turn)."""
    text, out = "", []
    targets = sorted(row.supervise) + ([None] if row.forced_close_answer is not None else [])
    for piece, trained in data.segments(row):
        if trained:
            out.append((text, piece, targets[len(out)]))
        text += piece
    assert len(out) == len(targets)
    return out


def server_parse(prompt: str, text: str, tools) -> tuple[str, str, list]:
    """The generated text through the parsers the server builds for this prompt (app.api.agent.prepare),
    fed one character at a time."""
    tool_parser = TOOL_PARSERS["qwen3_xml"]([t["function"] for t in tools]) if tools else None
    parser = OutputParser(ThinkParser(prompt_opens_reasoning(prompt)), tool_parser, [])
    pieces = [p for ch in text for p in parser.feed(ch)] + parser.finish()
    reasoning, content, _ = split(pieces)
    calls = [(c.name, json.loads(c.arguments)) for c in parser.tool_calls]
    return reasoning, content, calls


def test_template_is_the_python_renderer_and_every_trained_context_is_the_servers_prompt(template):
    kinds = set()
    for row in rows(150):
        assert template.render(row.messages, tools=row.tools, add_generation_prompt=False) == data.render(
            row.messages, row.tools)
        for prompt, _, index in trained_turns(row):
            if index is None:
                expected = template.render(row.messages, tools=row.tools, add_generation_prompt=True,
                                           enable_thinking=True) + data.FORCED_CLOSE
            else:
                expected = template.render(row.messages[:index], tools=row.tools, add_generation_prompt=True,
                                           enable_thinking=row.thinking)
            assert prompt == expected
            kinds.add((bool(row.tools), row.thinking, index is None))
    assert len(kinds) >= 6, kinds  # tools or not x thinking or not x forced close, all drawn


EDGE_CONVERSATIONS = [
    # content and two calls, a string argument, two tool results in one user turn, reasoning to trim
    ([{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": [{"type": "text", "text": "Go"}]},
      {"role": "assistant", "content": "Checking.", "reasoning_content": "  plan  ", "tool_calls": [
          {"id": "1", "type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}},
          {"id": "2", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a <b> & c"}}}]},
      {"role": "tool", "tool_call_id": "1", "content": "6"}, {"role": "tool", "tool_call_id": "2", "content": "x"},
      {"role": "assistant", "content": "6"}, {"role": "user", "content": "again"}], [data.MULTIPLY_TOOL]),
    # an empty system message with tools, a call without arguments, a system message later on
    ([{"role": "system", "content": ""}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "noop", "arguments": {}}}]},
      {"role": "tool", "content": [{"type": "text", "text": "done"}]}, {"role": "system", "content": "later"}],
     [data.MULTIPLY_TOOL, {"type": "function", "function": {"name": "noop", "parameters": {}}}]),
    ([{"role": "tool", "content": "orphan"}, {"role": "user", "content": "What is 1 + 1?"}], None),
]


@pytest.mark.parametrize(("messages", "tools"), EDGE_CONVERSATIONS)
@pytest.mark.parametrize("thinking", [None, False, True])
def test_template_equals_the_python_renderer_and_transformers_on_edge_cases(template, tokenizer, tmp_path,
                                                                            messages, tools, thinking):
    from transformers import AutoTokenizer

    tok, _ = tokenizer
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(train.tokenizer_config()))
    hf = AutoTokenizer.from_pretrained(tmp_path)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    for generation in (True, False):
        ours = template.render(messages, tools=tools, add_generation_prompt=generation, **kwargs)
        assert ours == data.render(messages, tools, generation, bool(thinking))
        assert ours == hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                              add_generation_prompt=generation, **kwargs)
    if tools and len(messages) > 3:
        assert "Checking.\n\n<tool_call>\n<function=multiply>" in ours or "<function=noop>\n</function>" in ours


def test_no_tools_and_no_thinking_render_the_first_demo_models_chatml(template):
    first = ChatTemplate(FIRST_TEMPLATE)
    conversations = [
        [{"role": "user", "content": "What is 19 + 23?"}],
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 7 - 30?"}],
        [{"role": "system", "content": ""}, {"role": "user", "content": [{"type": "text", "text": "What is 1 + 2?"}]}],
        [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3"},
         {"role": "user", "content": " What is 5 - 6? "}],
    ]
    for messages in conversations:
        for generation in (True, False):
            assert template.render(messages, add_generation_prompt=generation) == first.render(
                messages, add_generation_prompt=generation)
            assert template.render(messages, add_generation_prompt=generation, enable_thinking=False) == first.render(
                messages, add_generation_prompt=generation)
    assert template.render(conversations[0], enable_thinking=True).endswith("<|im_start|>assistant\n<think>\n")


def test_trained_answers_parse_with_the_servers_parsers_and_render_back(template):
    seen = set()
    for row in rows(150, seed=1):
        for prompt, piece, index in trained_turns(row):
            assert piece.endswith(data.IM_END) and data.IM_END not in piece[: -len(data.IM_END)]
            generated = piece[: -len(data.IM_END)]
            reasoning, content, calls = server_parse(prompt, generated, row.tools)
            if index is None:  # forced close: no reasoning, then the answer or the call
                user = row.messages[-1]["content"]
                a, op, b = QUESTION.match(user).groups()
                if data.is_product(op) and data.offers_multiply(row.tools):
                    assert (reasoning, content, calls) == ("", "", [("multiply", {"a": int(a), "b": int(b)})])
                else:
                    assert (reasoning, calls) == ("", []) and content == generated
                seen.add("forced")
                continue
            message = row.messages[index]
            assert reasoning == (message.get("reasoning_content") or "")
            expected_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
            assert calls == expected_calls and content == (message["content"] or "")
            seen.add("call" if calls else "refusal" if content == data.NO_TOOL_ANSWER else "number")
            # What a client sends back: the parsed call (arguments as JSON text, which the server turns
            # into an object), the content, the reasoning; rendered, it is the trained text again.
            back = {"role": "assistant", "content": content or None}
            if reasoning:
                back["reasoning_content"] = reasoning
            if calls:
                back["tool_calls"] = [{"id": "call_x", "type": "function", "function": {
                    "name": name, "arguments": arguments_object(json.dumps(args), "arguments")}} for name, args in calls]
            rendered = template.render(row.messages[:index] + [back], tools=row.tools, add_generation_prompt=False)
            assert rendered == prompt + piece + "\n"
    assert seen == {"call", "refusal", "number", "forced"}


def test_tool_call_text_is_what_qwen3_xml_parses():
    reasoning, content, calls = server_parse("<|im_start|>assistant\n", data.call_text(47, 8), [data.MULTIPLY_TOOL])
    assert (reasoning, content, calls) == ("", "", [("multiply", {"a": 47, "b": 8})])


def test_splits_are_fixed_and_training_never_sees_heldout_or_validation_questions():
    questions = data.all_questions()
    random.Random(20_260_101).shuffle(questions)  # the first demo model's held-out set, unchanged
    train_q, val_q, heldout_q = data.split_questions()
    assert heldout_q == sorted(questions[:2000]) and len(val_q) == 500 and len(train_q) == 17_500
    train_p, val_p, heldout_p = data.split_products()
    assert (len(train_p), len(val_p), len(heldout_p)) == (8700, 300, 1000)
    assert not (set(train_p) & set(heldout_p)) and not (set(train_p) & set(val_p)) and not (set(val_p) & set(heldout_p))
    allowed_sums, allowed_pairs = set(train_q), set(train_p)
    asked = 0
    for row in rows(300, seed=2):
        for m in row.messages:
            if m["role"] == "user":
                a, op, b = QUESTION.match(m["content"]).groups()
                if data.is_product(op):
                    assert (int(a), int(b)) in allowed_pairs
                else:
                    assert (int(a), op, int(b)) in allowed_sums
                asked += 1
    assert asked > 300
    not_heldout = set()
    for case in data.eval_cases(heldout_q, heldout_p, lambda i: "system text", every=20):
        for a, op, b in re.findall(r"user\nWhat is (\d+) (\+|-|×|\*|times) (\d+)\?", case.prompt):
            if not (((int(a), int(b)) in set(heldout_p)) if data.is_product(op) else ((int(a), op, int(b)) in heldout_q)):
                not_heldout.add(case.suite)
    assert not_heldout == {"arith_small"}  # the capability check, documented as not held-out; every other suite is


def test_small_operand_questions_are_drawn_at_their_share_and_only_from_the_training_split():
    """data.SMALL_SHARE of the +/- questions drawn come from the training questions with both operands in
    0..9 (1 % of them under a uniform draw), every such training question is drawn, and no held-out or
    validation question ever is, although 15 of the 200 small questions are held out or validation ones."""
    train_q, val_q, heldout_q = data.split_questions()
    small_train = {q for q in train_q if data.is_small(q)}
    assert len(data.small_questions()) == 200 and len(small_train) == 185
    assert {q for q in heldout_q + val_q if data.is_small(q)} == set(data.small_questions()) - small_train
    builder = train.make_builder(train.LongSystem(2.8, (60, 200)))
    assert builder.small_share == data.SMALL_SHARE == 0.08
    rng = random.Random(11)
    n = 40_000
    drawn = [builder.question(rng, product_share=0.0) for _ in range(n)]
    share = sum(map(data.is_small, drawn)) / n
    assert abs(share - data.SMALL_SHARE) < 0.006  # > 4 standard deviations (0.0014)
    assert {q for q in drawn if data.is_small(q)} == small_train  # all 185, ~17 draws each
    assert set(drawn) <= set(train_q)
    # the same seed draws the same questions; a share of 0 is the uniform draw (1.06 % small)
    rng = random.Random(11)
    assert [builder.question(rng, product_share=0.0) for _ in range(500)] == drawn[:500]
    uniform = train.make_builder(train.LongSystem(2.8, (60, 200)), small_share=0.0)
    rng = random.Random(11)
    uniform_share = sum(data.is_small(uniform.question(rng, product_share=0.0)) for _ in range(n)) / n
    assert abs(uniform_share - 185 / 17_500) < 0.003
    # ... and so do whole training rows of every kind (their +/- questions, not the products)
    asked = []
    for row in rows(900, seed=4):
        for m in row.messages:
            a, op, b = QUESTION.match(m["content"]).groups() if m["role"] == "user" else (0, "×", 0)
            if not data.is_product(op):
                asked.append((int(a), op, int(b)))
    assert len(asked) > 1500 and set(asked) <= set(train_q)
    assert 0.05 < sum(map(data.is_small, asked)) / len(asked) < 0.11


def test_small_share_is_checked():
    for share in (-0.1, 1.0):
        with pytest.raises(ValueError, match="small_share must be in"):
            data.ConversationBuilder([(1, "+", 2), (10, "+", 2)], [], lambda rng: "", ("",), share)
    with pytest.raises(ValueError, match="needs"):
        data.ConversationBuilder([(10, "+", 2)], [], lambda rng: "", ("",), 0.1)
    assert data.ConversationBuilder([(10, "+", 2)], [], lambda rng: "", ("",), 0.0).question(
        random.Random(0), 0.0) == (10, "+", 2)
    with pytest.raises(SystemExit):
        train.parse_args(["--out", "x", "--small-share", "1"])
    assert train.parse_args(["--out", "x"]).small_share == data.SMALL_SHARE


def test_arith_small_has_all_200_small_questions_at_every_thinning_and_validation_keeps_heldout_out():
    train_q, val_q, heldout_q = data.split_questions()
    _, _, heldout_p = data.split_products()
    for every in (1, 2, 12, 400):
        cases = [c for c in data.eval_cases(heldout_q, heldout_p, lambda i: "system", every=every)
                 if c.suite == "arith_small"]
        assert len(cases) == 200
        assert [(c.prompt, c.expected) for c in cases] == [
            (data.prompt_text(a, op, b), str(a + b if op == "+" else a - b)) for a, op, b in data.small_questions()]
    assert {c.expected for c in cases} >= {"0", "18", "-9"}
    assert ("What is 1 + 2?", "3") in {(c.prompt.split("user\n")[1].split("<|im_end|>")[0], c.expected) for c in cases}
    # The training loop's validation shows arith_small too, but without its 12 held-out questions (which
    # must never decide anything), and never the hand-written agent prompt.
    validation = train.validation_cases(train.LongSystem(2.8, (60, 200)), 12)
    suites = {c.suite for c in validation}
    assert "arith_small" in suites and not any(s.endswith("_agent") for s in suites)
    small = [c for c in validation if c.suite == "arith_small"]
    heldout_prompts = {data.prompt_text(*q) for q in heldout_q}
    assert len(small) == 188 and not any(c.prompt in heldout_prompts for c in small)
    assert {c.prompt for c in small} == {data.prompt_text(*q) for q in data.small_questions() if q not in set(heldout_q)}


def test_heldout_suites_and_their_expected_answers():
    _, _, heldout_q = data.split_questions()
    _, _, heldout_p = data.split_products()
    cases = data.eval_cases(heldout_q, heldout_p, lambda i: f"long system text {i}")
    counts = {}
    for case in cases:
        counts[case.suite] = counts.get(case.suite, 0) + 1
    assert counts == {"arith": 2000, "arith_small": 200, "arith_system": 500, "arith_long": 500, "arith_agent": 200,
                      "arith_tools_long": 250, "call": 1000, "call_long": 500, "call_agent": 200, "answer": 1000,
                      "answer_long": 500, "no_tool": 250, "no_tool_distractors": 250, "think_arith": 200,
                      "think_call": 200}
    for case in cases[::7]:
        tools = [data.MULTIPLY_TOOL] if "# Tools" in case.prompt else None
        reasoning, content, calls = server_parse(case.prompt, case.expected, tools)
        if case.suite.startswith(("call", "think_call")):
            assert len(calls) == 1 and calls[0][0] == "multiply" and content == ""
        else:
            assert calls == [] and content
        assert bool(reasoning) == case.suite.startswith("think")
    answers = [c for c in cases if c.suite == "answer"]
    not_product = [c for c in answers if c.expected != str(eval(re.search(r"What is (\d+) \S+ (\d+)\?", c.prompt)
                                                               .expand(r"\1*\2")))]
    assert 400 <= len(not_product) <= 510  # every other tool result is not the product


def test_tokenizer_digits_markup_and_piecewise_encoding(tokenizer):
    tok, chars_per_token = tokenizer
    assert [tok.token_to_id(t) for t in data.SPECIAL_TOKENS] == [0, 1, 2]
    for markup in data.MARKUP_TOKENS:
        ids = tok.encode("x" + markup + "\n").ids
        assert tok.token_to_id(markup) in ids and tok.decode(ids, skip_special_tokens=True) == "x" + markup + "\n"
    digits = [t for t in tok.encode("x 9876543210 y").tokens if t.strip("Ġ").isdigit()]
    assert digits == list("9876543210")
    assert 2.0 < chars_per_token < 4.0
    again, _ = train.build_tokenizer(0)
    assert again.get_vocab() == tok.get_vocab() and again.to_str() == tok.to_str()  # follows the seed
    # encode_rows encodes each piece on its own; that must equal encoding the whole text, as the server does
    for row in rows(60, seed=3):
        [(ids, labels)], _ = train.encode_rows(tok, [row], 100_000)
        assert ids == tok.encode("".join(t for t, _ in data.segments(row))).ids
        trained = "".join(t for t, trained in data.segments(row) if trained)
        assert tok.decode([i for i, label in zip(ids, labels, strict=True) if label != -100],
                          skip_special_tokens=False) == trained


def test_long_system_prompts_are_sized_varied_deterministic_and_never_mention_multiply(tokenizer):
    tok, chars_per_token = tokenizer
    long_system = train.LongSystem(chars_per_token)
    texts = [long_system(random.Random(i)) for i in range(40)]
    assert texts[:5] == [long_system(random.Random(i)) for i in range(5)]
    assert len(set(texts)) == 40 and all("multiply" not in t for t in texts)
    lengths = [len(e.ids) for e in tok.encode_batch(texts)]
    assert min(lengths) >= 0.7 * train.LONG_SYSTEM_TOKENS[0] and max(lengths) <= 1.4 * train.LONG_SYSTEM_TOKENS[1]
    assert max(lengths) - min(lengths) > 800
    joined = "\n".join(texts)
    assert re.search(r"What is \d+ [+-] \d+\?", joined)  # arithmetic in examples: answer the last user turn
    assert "multiply" not in data.HANDWRITTEN_AGENT_PROMPT


def test_pool_and_batches_follow_the_seed(tokenizer):
    tok, chars_per_token = tokenizer
    builder = train.make_builder(train.LongSystem(chars_per_token, (60, 120)))
    chances = train.kind_chances(tok, builder, {"plain": 0.3, "tools": 0.2, "long": 0.5}, 5)
    # plain rows are ~10x shorter than the others, so most rows are plain for 30 % of the tokens
    assert chances["plain"] > 0.5 and min(chances.values()) > 0 and abs(sum(chances.values()) - 1) < 1e-9
    pool, dropped = train.build_pool(tok, builder, 80, chances, 5, 4096)
    again, _ = train.build_pool(tok, builder, 80, chances, 5, 4096)
    assert pool == again and dropped == 0 and len(pool) == 80
    first = train.Batches(pool, 2048, 0, "cpu", 5)
    second = train.Batches(pool, 2048, 0, "cpu", 5)
    for _ in range(5):
        (a_ids, a_labels), (b_ids, b_labels) = first.sample(), second.sample()
        assert torch.equal(a_ids, b_ids) and torch.equal(a_labels, b_labels)
        assert a_ids.shape[0] * a_ids.shape[1] <= 2048 or a_ids.shape[0] == 1
        assert (a_labels != -100).any()


@pytest.mark.slow
def test_a_short_cpu_training_run_lowers_the_loss(tmp_path):
    torch.set_num_threads(1)
    args = train.parse_args(["--device", "cpu", "--steps", "24", "--warmup", "8", "--tokens-per-step", "1024",
                             "--pool-rows", "120", "--long-system-tokens", "60", "150", "--max-row-tokens", "768",
                             "--eval-every", "0", "--val-every-nth", "0", "--heldout-every-nth", "0",
                             "--log-every", "8", "--out", str(tmp_path / "ckpt")])
    result = train.train(args)
    losses = result["losses"]
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    print(f"loss {first:.3f} -> {last:.3f} over {len(losses)} steps")
    assert len(losses) == 24 and last < 0.6 * first
    result["report"]["heldout_suites"] = {"arith": {"right": 1, "n": 2, "exact": 0.5, "wrong": []}}
    train.write_checkpoint(result, tmp_path / "ckpt", "test")
    assert "`arith`: 1/2" in (tmp_path / "ckpt" / "README.md").read_text()
    written = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "heldout_eval.json",
            "README.md", "generation_config.json"} <= written
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["max_position_embeddings"] == train.MAX_POSITIONS and config["vocab_size"] == 1030
