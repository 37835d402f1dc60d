"""The engine's API-process side: `AsyncEngine` (starts and talks to the core process), request
validation and tokenizing (`input_processor`), detokenizing and stop strings (`output_processor`),
per-request streams. No torch, nothing of `core` or `runner` (tests/test_layering.py)."""
