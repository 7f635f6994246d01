"""Serving-engine integrations of the ``dbo`` backend (``vllm``: :mod:`.vllm`).

Each integration imports its engine lazily: ``import dbo_compile`` never needs it.
"""
