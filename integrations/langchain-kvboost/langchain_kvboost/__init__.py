"""LangChain integration of kvboost-rag.

>>> from langchain_kvboost import ChatKVBoost
>>> llm = ChatKVBoost(model="smollm2-135m-instruct", max_tokens=32)  # cheap: the engine loads on first use
>>> llm.model
'smollm2-135m-instruct'
"""

from langchain_kvboost.chat_models import ChatKVBoost, clear_engines
from langchain_kvboost.documents import documents_to_blocks, prewarm_documents

__all__ = ["ChatKVBoost", "clear_engines", "documents_to_blocks", "prewarm_documents"]
