"""Speculative decoding: the speculator around the scheduler, the proposers (draft model, prompt
lookup) and the control that chooses k per request and whether to speculate at all."""
