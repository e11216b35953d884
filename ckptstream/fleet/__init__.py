"""Rollout fleets: vLLM servers following a stream behind a vLLM router (Ray fleet: extra ``ray``)."""
