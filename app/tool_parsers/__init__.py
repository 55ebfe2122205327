"""Tool-call parsers by name (``--tool-call-parser``); see base.py for the streaming contract."""

from __future__ import annotations

from app.tool_parsers.base import ToolCall, ToolCallDelta, ToolParser, random_call_id
from app.tool_parsers.hermes import HermesToolParser
from app.tool_parsers.qwen3_xml import Qwen3XmlToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "qwen3_xml": Qwen3XmlToolParser,
    "qwen3_coder": Qwen3XmlToolParser,
    "hermes": HermesToolParser,
}
# NOTE: what each architecture's published checkpoints emit (Qwen3.5/3.6: XML; Qwen3: Hermes JSON).
DEFAULT_BY_ARCHITECTURE = {"qwen3_5_moe": "qwen3_xml", "qwen3_moe": "hermes"}

__all__ = ["TOOL_PARSERS", "DEFAULT_BY_ARCHITECTURE", "ToolCall", "ToolCallDelta", "ToolParser", "random_call_id"]
