"""scripts/train_demo_model.py --evaluate: a training run with --heldout-every-nth 0 writes a complete
checkpoint, and --evaluate DIR later (here: the CPU, after a GPU training run) adds the held-out report to
DIR's heldout_eval.json and README.md, keeping the training report, exactly as a run that evaluated
in-process would have written it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import demo_model_data as data  # noqa: E402
import train_demo_model as train  # noqa: E402

CHECKPOINT_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json", "heldout_eval.json", "README.md"}
HELDOUT_KEYS = {"heldout_every_nth", "heldout_exact", "heldout_exact_with_system_message", "heldout_suites",
                "heldout_eval_seconds", "heldout_device", "heldout_torch", "heldout_transformers"}
# Differ between two otherwise identical runs: wall times, and the command line (--heldout-every-nth).
RUN_SPECIFIC = {"train_seconds", "heldout_eval_seconds", "command"}


def test_evaluate_options_are_checked(tmp_path, capsys):
    for argv, message in ((["--evaluate", str(tmp_path), "--out", str(tmp_path)], "leave out --out"),
                          (["--evaluate", str(tmp_path), "--heldout-every-nth", "0"], "--heldout-every-nth >= 1"),
                          ([], "--out is required"),
                          (["--out", str(tmp_path), "--heldout-every-nth", "-1"], "must be >= 0")):
        with pytest.raises(SystemExit):
            train.parse_args(argv)
        assert message in capsys.readouterr().err
    assert train.parse_args(["--evaluate", str(tmp_path)]).out is None


def test_evaluate_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(train.CheckpointError, match="no generation_config.json, model.safetensors, tokenizer.json"):
        train.load_checkpoint(tmp_path, "cpu")
    with pytest.raises(SystemExit, match="is not a checkpoint this script wrote"):
        train.main(["--device", "cpu", "--evaluate", str(tmp_path)])


def test_greedy_answers_do_not_depend_on_the_batching():
    """Left padding is exact and every row keeps only its own new-token budget, so one prompt a batch and
    all prompts in one batch give the same texts (the CPU and the GPU batch differently)."""
    from transformers import Qwen3_5MoeForCausalLM

    tokenizer, _ = train.build_tokenizer(0)
    pad_id, eos_id = tokenizer.token_to_id(data.END_OF_TEXT), tokenizer.token_to_id(data.IM_END)
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(train.model_config(tokenizer.get_vocab_size(), pad_id, eos_id)).eval()
    tools = [data.MULTIPLY_TOOL]
    prompts = [data.prompt_text(3, "+", 4), data.prompt_text(71, "-", 9, "You are a helpful assistant."),
               data.render([{"role": "user", "content": "What is 6 × 7?"}], tools, True),
               data.render([{"role": "user", "content": "What is 2 × 5?"}], tools, True, True)]
    max_new = [3, 5, 12, 20]
    one_by_one = train.greedy(model, tokenizer, prompts, max_new, "cpu", tokens_per_batch=1)
    together = train.greedy(model, tokenizer, prompts, max_new, "cpu", tokens_per_batch=10**6)
    assert together == one_by_one  # one_by_one: each row's batch ran exactly to its own budget
    assert any(together)  # an untrained model writes something, so the budgets are exercised


def test_training_without_heldout_then_evaluate_writes_what_an_evaluating_run_writes(tmp_path):
    torch.set_num_threads(1)  # the same arithmetic in both runs
    common = ["--device", "cpu", "--seed", "3", "--steps", "4", "--warmup", "2", "--tokens-per-step", "512",
              "--pool-rows", "40", "--long-system-tokens", "60", "150", "--max-row-tokens", "768",
              "--eval-every", "0", "--val-every-nth", "0", "--log-every", "2"]
    every = 400  # still at least one case in every suite
    first, second = tmp_path / "train-only", tmp_path / "in-process"

    train.main(common + ["--heldout-every-nth", "0", "--out", str(first)])
    assert CHECKPOINT_FILES <= {p.name for p in first.iterdir()}
    trained = json.loads((first / "heldout_eval.json").read_text())
    assert not HELDOUT_KEYS & set(trained)
    assert trained["steps_run"] == 4 and trained["long_system_tokens"] == [60, 150] and trained["history"]
    assert "(not evaluated)" in (first / "README.md").read_text()
    weights = (first / "model.safetensors").read_bytes()

    # The long system prompts are rebuilt from the saved tokenizer exactly as the training run built them.
    assert train.load_checkpoint(first, "cpu")["long_system"].chars_per_token == train.build_tokenizer(3)[1]

    train.main(["--device", "cpu", "--evaluate", str(first), "--heldout-every-nth", str(every)])
    evaluated = json.loads((first / "heldout_eval.json").read_text())
    assert {k: evaluated[k] for k in trained} == trained  # the training report is kept as it was
    assert set(evaluated) - set(trained) == HELDOUT_KEYS
    cases = data.eval_cases(data.split_questions()[2], data.split_products()[2], lambda i: "", every=every)
    expected_n: dict[str, int] = {}
    for case in cases:
        expected_n[case.suite] = expected_n.get(case.suite, 0) + 1
    assert {name: s["n"] for name, s in evaluated["heldout_suites"].items()} == expected_n
    assert expected_n["arith_small"] == 200 and trained["small_share"] == data.SMALL_SHARE  # never thinned
    assert evaluated["heldout_exact"] == evaluated["heldout_suites"]["arith"]["exact"]
    assert evaluated["heldout_exact_with_system_message"] == evaluated["heldout_suites"]["arith_system"]["exact"]
    assert evaluated["heldout_every_nth"] == every and evaluated["heldout_device"] == "cpu"
    readme = (first / "README.md").read_text()
    arith = evaluated["heldout_suites"]["arith"]
    assert f"`arith`: {arith['right']}/{arith['n']}" in readme and "(not evaluated)" not in readme
    small = evaluated["heldout_suites"]["arith_small"]
    assert f"`arith_small`: {small['right']}/200 (a capability check, not held-out" in readme
    assert f"--heldout-every-nth 0 --out {first}" in readme  # the training command, not the evaluation's
    assert (first / "model.safetensors").read_bytes() == weights  # --evaluate writes only the report

    # The same training with the held-out report in-process: the same files but for wall times and command.
    train.main(common + ["--heldout-every-nth", str(every), "--out", str(second)])
    in_process = json.loads((second / "heldout_eval.json").read_text())
    assert set(in_process) == set(evaluated)
    assert ({k: v for k, v in in_process.items() if k not in RUN_SPECIFIC}
            == {k: v for k, v in evaluated.items() if k not in RUN_SPECIFIC})
    assert (second / "model.safetensors").read_bytes() == weights

    # A report that does not belong to the tokenizer is refused, not evaluated with other prompts.
    third = tmp_path / "mismatched"
    shutil.copytree(first, third)
    report = json.loads((third / "heldout_eval.json").read_text())
    (third / "heldout_eval.json").write_text(json.dumps(dict(report, chars_per_token=report["chars_per_token"] + 0.01)))
    with pytest.raises(train.CheckpointError, match="from different runs"):
        train.load_checkpoint(third, "cpu")
