"""Attention backends: how K/V reach the cache (with RoPE, in one pass) and how paged attention is
computed.

`TorchAttention` runs the torch references from kernels/ on any device; `CpuAttention` (a CPU's
default) the same, with attention itself in the C kernel of kernels/specserve_kernels/paged_attention_cpu.py where
it runs (float32); `TritonAttention` runs the Triton kernels (CUDA, or CPU under
TRITON_INTERPRET=1). All take the same metadata.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve_kernels import paged_attention_cpu
from specserve_kernels.paged_attention import ReferencePlan, paged_attention_ref, plan_reference
from specserve_kernels.rotary import rotary_store_kv_ref, rotary_tables


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32: prefix sums of query lengths
    seq_lens: torch.Tensor  # [batch] int32: context length incl. this step's tokens
    block_tables: torch.Tensor  # [batch, max_blocks] int32, padded with 0
    max_seqlen_q: int
    max_seqlen_k: int
    reference_plan: ReferencePlan | None = None  # TorchAttention's per-step host work, made once


class AttentionBackend:
    name = "base"
    supports_cuda_graphs = False  # True when forward never syncs with the host

    def rotate_and_store(self, q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
        """RoPE of q and k; the rotated k and v stored at their cache slots. Returns the rotated q
        (kernels/specserve_kernels/rotary.py, `rotary_store_kv`)."""
        raise NotImplementedError

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError


class TorchAttention(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        # the rotation of the last positions seen, (positions, cos table, its rotary_tables): every
        # layer of a step passes the same tensors, so the first computes it and the others reuse it
        self._rotation: tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

    def rotate_and_store(self, q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
        last = self._rotation
        if last is None or last[0] is not positions or last[1] is not cos:
            last = self._rotation = (positions, cos, rotary_tables(positions, cos, sin))
        return rotary_store_kv_ref(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, last[2])

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.reference_plan is None:  # first layer of the step; the others reuse it
            meta.reference_plan = plan_reference(meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                                 k_cache.shape[1], k_cache.shape[0])
        return paged_attention_ref(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale,
            meta.max_seqlen_q, meta.max_seqlen_k, meta.reference_plan,
        )


class CpuAttention(TorchAttention):
    """TorchAttention with attention in the CPU kernel, which reads the pool through the block
    tables and needs no plan (about 20 us a layer where the reference took 130-400 us on the
    default model's steps); where it does not apply (not float32), the reference."""

    name = "cpu"

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not paged_attention_cpu.supports(q, k_cache):
            return super().forward(q, k_cache, v_cache, meta, scale)
        return paged_attention_cpu.kernel_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens,
                                                    meta.block_tables, scale)


class TritonAttention(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        from specserve_kernels.paged_attention import paged_attention
        from specserve_kernels.rotary import rotary_store_kv

        self._rotate_and_store = rotary_store_kv  # one launch for RoPE and the store
        self._attend = paged_attention

    def rotate_and_store(self, q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
        return self._rotate_and_store(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._attend(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale,
            meta.max_seqlen_q, meta.max_seqlen_k,
        )


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu" if paged_attention_cpu.available() else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "cpu":
        return CpuAttention()
    if name == "triton":
        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}")
