"""Unit tests of kvboost_rag.server, one module each; tests/test_server.py serves a real engine over HTTP."""
