"""Fixtures shipped for users' own tests: tiny random models, RL-like steps, the generic storage suite,
a fake vLLM client, HTTP servers (a static file server, a proxy that resets connections). Import the
submodule you need; importing this package imports nothing heavy."""
