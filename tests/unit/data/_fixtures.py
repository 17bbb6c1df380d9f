"""Test data shared by the data-stage tests (test_prompts, test_tokenize, test_regenerate)."""

from tests.conftest import REPO

TOOL_CONVERSATION = REPO / "tests" / "data" / "tool_conversation.jsonl"
