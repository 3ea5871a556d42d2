"""Host staging for the inputs of a CUDA graph step: written in place each step, uploaded in one
copy per input. A graph step computes the same number q of tokens for every request: 1 (decode)
or k + 1 (a verification of k drafts each).

A decode step of B requests needs B block-table rows of up to max_model_len / block_size entries;
building them anew each step (B x max_blocks Python ints: 65,536 at B = 256, 4,096-token context)
cost more host time than the GPU spent on the step. Here each row remembers the table it holds and
is rewritten only when the request at that row, or its table, changed: in a steady decode batch
that is the few requests that crossed a block boundary. Entries past a row's table are left stale;
seq_lens bounds every read, so they are never read. Padding rows (past the batch, up to the graph's
bucket) write nowhere (slot PAD_SLOT) and read q tokens of block PAD_BLOCK.

On CUDA the buffers are pinned, so uploads are asynchronous: a set of buffers is written again
only once its upload has read it. Two sets are used in turn. A set comes back two uploads later,
after the host has waited for a later point of the device's queue (overlapped, the read-back of
the step it was staged for, while the next step runs; a draft's forwards, the read-back of the
verification between them), so its reuse costs no wait of its own (host_waits.py).
"""
from __future__ import annotations

import torch

from backend.host_waits import DeviceMark, HostWaits
from specserve_kernels.kv_cache import PAD_SLOT  # slot of a padding token: its K/V are not stored

PAD_BLOCK = 0  # block id that pads block tables (never read past seq_lens)
_PAD_ROW = [PAD_BLOCK]


class _Staging:
    """One set of host buffers, the table each of its rows holds, and its last upload's mark."""

    def __init__(self, max_batch: int, max_blocks: int, max_tokens: int, pin: bool):
        def buffer(*shape, dtype, fill):
            t = torch.full(shape, fill, dtype=dtype)
            return t.pin_memory() if pin else t

        self.tensors = dict(
            input_ids=buffer(max_tokens, dtype=torch.int64, fill=0),
            positions=buffer(max_tokens, dtype=torch.int64, fill=0),
            slot_mapping=buffer(max_tokens, dtype=torch.int64, fill=PAD_SLOT),
            seq_lens=buffer(max_batch, dtype=torch.int32, fill=1),
            block_tables=buffer(max_batch, max_blocks, dtype=torch.int32, fill=PAD_BLOCK),
        )
        self.arrays = {name: t.numpy() for name, t in self.tensors.items()}
        self.rows: list[list[int]] = [_PAD_ROW] * max_batch  # the table each row holds now
        self.uploaded: DeviceMark | None = None


class DecodeInputs:
    def __init__(self, max_batch: int, max_blocks: int, pin: bool, waits: HostWaits | None = None,
                 max_tokens_per_row: int = 1, depth: int = 2):
        self.sets = [_Staging(max_batch, max_blocks, max_batch * max_tokens_per_row, pin) for _ in range(depth)]
        self.waits = waits if waits is not None else HostWaits()
        self._next = 0  # the set the next fill writes

    def fill(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
             block_tables: list[list[int]], bucket: int, q: int = 1) -> dict[str, torch.Tensor]:
        """Write one graph step (q tokens per request, flat) and padding up to `bucket` rows;
        returns views of what the graph of `bucket` rows reads."""
        staging = self.sets[self._next]
        if staging.uploaded is not None:
            self.waits.wait(staging.uploaded)  # its last upload has read the buffers
            staging.uploaded = None
        b = len(seq_lens)
        a = staging.arrays
        for name, values, pad, rows in (("input_ids", input_ids, 0, q), ("positions", positions, 0, q),
                                        ("slot_mapping", slots, PAD_SLOT, q), ("seq_lens", seq_lens, q, 1)):
            a[name][: b * rows] = values
            a[name][b * rows : bucket * rows] = pad
        tables, rows = a["block_tables"], staging.rows
        for i, table in enumerate(block_tables):
            if rows[i] != table:
                tables[i, : len(table)] = table
                rows[i] = table.copy()
        for i in range(b, bucket):
            if rows[i] is not _PAD_ROW:
                tables[i, 0] = PAD_BLOCK
                rows[i] = _PAD_ROW
        views = {name: t[: bucket * (1 if name in ("seq_lens", "block_tables") else q)]
                 for name, t in staging.tensors.items()}
        # only the columns some request of the step reaches: the graph reads no block past a
        # row's context, so what stays in the device's columns beyond is never read
        views["block_tables"] = views["block_tables"][:, : max((len(t) for t in block_tables), default=1)]
        return views

    def upload(self, views: dict[str, torch.Tensor], device_tensors: dict[str, torch.Tensor]) -> None:
        """Copy what `fill` returned into the graph's static inputs (asynchronous on CUDA); the
        next fill writes the next set."""
        for name, view in views.items():
            device_tensors[name][tuple(slice(n) for n in view.shape)].copy_(view, non_blocking=True)
        device = next(iter(device_tensors.values())).device
        self.sets[self._next].uploaded = self.waits.mark(device)
        self._next = (self._next + 1) % len(self.sets)
