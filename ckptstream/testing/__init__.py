"""Fixtures shipped for users' own tests: tiny random models, RL-like steps, the generic storage suite,
a fake vLLM client. Import the submodule you need; importing this package imports nothing heavy."""
