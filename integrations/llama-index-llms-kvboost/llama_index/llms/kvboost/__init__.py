"""LlamaIndex integration of kvboost-rag: the KVBoost LLM and the KVPrewarm ingestion step.

>>> from llama_index.llms.kvboost import KVBoost
>>> llm = KVBoost(model="smollm2-135m-instruct", max_new_tokens=32)  # cheap: the engine loads on first use
>>> llm.model
'smollm2-135m-instruct'
"""

from llama_index.llms.kvboost.base import KVBoost
from llama_index.llms.kvboost.prewarm import KEY_METADATA, KVPrewarm
from llama_index.llms.kvboost.usage import KVBoostUsageHandler, LLMCallUsage

__all__ = ["KEY_METADATA", "KVBoost", "KVBoostUsageHandler", "KVPrewarm", "LLMCallUsage"]
