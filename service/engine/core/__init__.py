"""The engine core: the step loop (`engine_core`), the scheduler, the KV block manager, sequences and
the grammars' bitmasks. Token ids in, token ids out; the model is behind the executor protocol. No
torch, nothing of `runner` or `client` (tests/test_layering.py): it runs in CPU unit tests as it runs in
the core process."""
