"""langchain-tests standard suites for ChatKVBoost, offline on Qwen2.5-Coder-0.5B (a tool-calling chat
template): every test passes, or is skipped for a capability declared absent (images, audio, PDF)."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from langchain_kvboost import ChatKVBoost  # noqa: E402

MODEL = "qwen2.5-coder-0.5b-instruct"
PARAMS = {"model": MODEL, "dtype": "float32"}
INTEGRATION_PARAMS = PARAMS | {"max_tokens": 72}  # room for a tool call's JSON
LONG_SYSTEM = "You are a helpful assistant for a library. " * 40  # several chunks, reused by the second call


class Capabilities:
    """What both suites are told ChatKVBoost on Qwen2.5 does."""

    @property
    def chat_model_class(self) -> type[ChatKVBoost]:
        return ChatKVBoost

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True


class TestChatKVBoostUnit(Capabilities, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict:
        return PARAMS

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        return {}, {"model": MODEL}, {}


@pytest.mark.real_model
class TestChatKVBoostIntegration(Capabilities, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict:
        return INTEGRATION_PARAMS

    @property
    def model_override_value(self) -> str:
        return "smollm2-135m-instruct"  # invoke(..., model=...) runs on that model's shared engine

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {
            "invoke": ["cache_read_input", "cache_creation_input"],
            "stream": ["cache_read_input", "cache_creation_input"],
        }

    def _twice(self, *, stream: bool) -> tuple[AIMessage, AIMessage]:
        llm = ChatKVBoost(**(INTEGRATION_PARAMS | {"max_tokens": 8}))
        messages = [SystemMessage(LONG_SYSTEM), HumanMessage("Say hello.")]
        results = []
        for _ in range(2):
            if stream:
                full = None
                for chunk in llm.stream(messages):
                    full = chunk if full is None else full + chunk
                results.append(full)
            else:
                results.append(llm.invoke(messages))
        return results[0], results[1]

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        return self._twice(stream=stream)[1]

    def invoke_with_cache_creation_input(self, *, stream: bool = False) -> AIMessage:
        from langchain_kvboost import clear_engines

        clear_engines()  # a fresh engine has an empty memory store: everything is newly stored
        return self._twice(stream=stream)[0]
