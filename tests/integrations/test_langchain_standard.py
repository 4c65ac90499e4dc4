"""langchain-tests standard suites for ChatKVBoost, offline on SmolLM2-135M."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from langchain_kvboost import ChatKVBoost  # noqa: E402

PARAMS = {"model": "smollm2-135m-instruct", "dtype": "float32"}
INTEGRATION_PARAMS = PARAMS | {"max_tokens": 24}  # short answers keep the suite fast
LONG_SYSTEM = "You are a helpful assistant for a library. " * 40  # several chunks, reused by the second call


class TestChatKVBoostUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatKVBoost]:
        return ChatKVBoost

    @property
    def chat_model_params(self) -> dict:
        return PARAMS

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        return {}, {"model": "smollm2-135m-instruct"}, {}


@pytest.mark.real_model
class TestChatKVBoostIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatKVBoost]:
        return ChatKVBoost

    @property
    def chat_model_params(self) -> dict:
        return INTEGRATION_PARAMS

    @property
    def has_tool_calling(self) -> bool:
        # a 135M model does not call tools reliably; the tool suites run on Qwen2.5 (test_langchain_tools)
        return False

    @property
    def has_structured_output(self) -> bool:
        return False  # same: structured output goes through tool calls

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
        llm = ChatKVBoost(**INTEGRATION_PARAMS)
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
