"""The embedded demo model: a tiny qwen3_5_moe trained on two-number arithmetic that calls a
`multiply` tool (in the Qwen3.5/3.6 XML tool format) for products when one is offered.

`DEMO_MODEL_DIR` is an ordinary Hugging Face checkpoint directory (config.json,
model.safetensors, tokenizer files with a ChatML template that renders tools, tool calls and
thinking); scripts/train_demo_model.py wrote it and docs/demo-model.md describes it. Nothing here imports torch: this module only names
the path.
"""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "checkpoint"
# The id `ft serve` gives it on /v1/models when no --served-model-name is set (the directory's
# own name, `checkpoint`, would say nothing to a client).
DEMO_MODEL_NAME = "fluxtide-demo-arithmetic"
