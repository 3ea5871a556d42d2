"""Speculative decoding: the speculator around the scheduler, the proposers (draft model, prompt
lookup) and the policy that chooses k per request."""
