"""Requests and their scheduling: the request, the scheduler (one token budget per step), the paged
KV block manager, the limits a request is checked against, detokenizing and output processing."""
