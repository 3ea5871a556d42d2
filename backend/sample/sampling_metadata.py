"""One step's sampling inputs, built on the host in one pass and uploaded once.

The step samples for B requests. Request b has 1 + k_b consecutive rows of logits: its last
token's, then one per draft token to verify (k_b = 0 when it does not speculate); R rows in all,
D = sum k_b draft tokens. Row i of request b sees the draft tokens before it as output (penalties,
min_tokens).

A row's token is either decided by the row alone or drawn from the engine's stream. Decided: a
greedy row takes its argmax, a seeded row its sample keyed on (seed, output index)
(seeded_noise.py); a draft is kept iff it equals that token, so a seeded request's tokens depend
on its seed and its own context only, not on its batch-mates, what was drafted or k. Drawn: an
unseeded sampled request takes k_b + 1 uniforms from the engine's generator, for rejection
sampling (rejection_sampler.py).

A constrained request (guided decoding) gets its rows' allowed-token bitmasks from its grammar
state (backend/core/guide.py): `grammar_bitmask` [R, ceil(vocab / 32)] int32 and the rows it
applies to, `grammar_rows`; both None when no row is constrained, so unconstrained steps pay
nothing. The draft model's own sampling (constrain=False) is not masked: its drafts are verified
against the masked target, which keeps the output exact (sampler.py).

A request whose rows cannot be built (a stop token id past the vocabulary) gets neutral rows and
its exception in `errors`: it fails alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import xgrammar

from backend.core.guide import Guide, fill_masks
from backend.core.request import Request
from backend.errors import is_fatal
from backend.sample.seeded_noise import row_keys, seed_key
from backend.uploads import on_device


class _Packed:
    """Host lists of one dtype, uploaded in one copy and handed back as views of it."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.values: list = []
        self.sizes: list[int] = []

    def add(self, values) -> int:
        """Queue a list; returns its index among the views `upload` returns."""
        self.values.extend(values)
        self.sizes.append(len(values))
        return len(self.sizes) - 1

    def upload(self, device: torch.device) -> list[torch.Tensor]:
        return list(on_device(self.values, device, self.dtype).split(self.sizes))


@dataclass(slots=True)
class Penalties:
    """Repetition (prompt + output), presence and frequency (output) penalties of the rows."""
    repetition: torch.Tensor  # [R] float32, 1.0: none
    frequency: torch.Tensor  # [R] float32
    presence: torch.Tensor  # [R] float32
    output_rows: torch.Tensor  # [N] int64: row of each output token counted ...
    output_tokens: torch.Tensor  # [N] int64: ... and the token
    prompt_rows: torch.Tensor  # [M] int64: row of each prompt token a repetition penalty sees ...
    prompt_tokens: torch.Tensor  # [M] int64: ... and the token


@dataclass(slots=True)
class SamplingMetadata:
    requests: list[Request]  # B, in row order
    num_drafts: list[int]  # per request: k_b
    errors: dict[str, Exception]  # request id -> why its rows could not be built
    logprob_rows: list[int]  # rows whose requests asked for logprobs
    max_logprobs: int  # the largest top-n asked for
    all_greedy: bool
    any_greedy: bool
    any_drawn: bool  # some request draws from the engine's stream (sampled, unseeded)
    max_k: int
    # on the device
    greedy: torch.Tensor  # [B] bool
    decided: torch.Tensor  # [B] bool: greedy or seeded, its rows' tokens decided row by row
    first_row: torch.Tensor  # [B] int64: request b's rows are first_row[b] .. first_row[b] + k_b
    num_drafts_t: torch.Tensor  # [B] int64
    draft_offset: torch.Tensor  # [B] int64: request b's first draft token in the flat drafts
    draft_token_ids: torch.Tensor  # [D] int64
    draft_request: torch.Tensor  # [D] int64: request of each draft token
    draft_position: torch.Tensor  # [D] int64: its position 0 .. k_b - 1
    row_slot: torch.Tensor  # [R] int64: row r -> b * (max_k + 1) + i, its place in the output
    temperature: torch.Tensor  # [R] float32, 1.0 for greedy rows
    top_k: torch.Tensor | None  # [R] int64 (vocab: none); None when no row filters
    top_p: torch.Tensor | None  # [R] float32
    min_p: torch.Tensor | None  # [R] float32; None when no row asks
    penalties: Penalties | None  # None when no row has one
    banned_rows: torch.Tensor | None  # [N] int64: (row, token) masked to -inf before min_tokens
    banned_tokens: torch.Tensor | None
    uniform_drafts: torch.Tensor  # [D] float32: accept draft token j when u_j q(d_j) < p(d_j)
    uniform_last: torch.Tensor  # [B] float32: draws the recovered or bonus token
    seeded_rows: torch.Tensor | None  # [S] int64: the rows of seeded sampled requests; None: none
    seeded_keys: torch.Tensor | None  # [S] int64: their noise keys (seed, output index)
    grammar_bitmask: torch.Tensor | None = None  # [R, ceil(vocab / 32)] int32: allowed tokens, 1 bits
    grammar_rows: list[int] | None = None  # the rows it applies to; None: every row (or none, without a bitmask)


@dataclass(slots=True)
class _TokenRows:
    """(row, token) pairs: output tokens the penalties count (the drafts before a row included),
    prompt tokens a repetition penalty sees, and tokens banned before min_tokens."""
    output_rows: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    banned_rows: list[int] = field(default_factory=list)
    banned_tokens: list[int] = field(default_factory=list)

    def extend(self, other: _TokenRows) -> None:
        for name in self.__slots__:
            getattr(self, name).extend(getattr(other, name))


def _token_rows(request: Request, draft: list[int], row: int, vocab_size: int) -> _TokenRows:
    """One request's pairs, its rows starting at `row`; IndexError for a stop token id outside
    the vocabulary."""
    p = request.params
    banned = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(request.eos_token_ids))
    if any(not 0 <= t < vocab_size for t in banned):
        raise IndexError(f"a stop token id is outside the vocabulary [0, {vocab_size})")
    penalized = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
    out = _TokenRows()
    for i in range(len(draft) + 1):
        if penalized:
            counted = request.output_token_ids + draft[:i]
            out.output_rows.extend([row + i] * len(counted))
            out.output_tokens.extend(counted)
            if p.repetition_penalty != 1.0:
                out.prompt_rows.extend([row + i] * request.num_prompt_tokens)
                out.prompt_tokens.extend(request.prompt_token_ids)
        if request.num_output_tokens + i < p.min_tokens and banned:
            out.banned_rows.extend([row + i] * len(banned))
            out.banned_tokens.extend(banned)
    return out


@dataclass(slots=True)
class _Rows:
    """One request's rows on the host."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    greedy: bool = True
    banned: tuple[int, ...] = ()  # per row i: banned while its output count is below min_tokens


def build_sampling_metadata(
    requests: list[Request],
    drafts: list[list[int]],  # per request: the draft tokens to verify (empty: sample one token)
    vocab_size: int,
    generator: torch.Generator,  # the engine's, for requests without a seed
    device: torch.device,
    constrain: bool = True,  # apply the requests' grammars (the target's rows; not the draft's)
    ahead: int = 0,  # tokens past its known ones each request's first row samples (a draft's j-th draw)
    position_offsets: torch.Tensor | None = None,  # [B] on the device: added to those (tokens the
    # host does not know of yet, overlapped steps)
) -> SamplingMetadata:
    num_drafts = [len(d) for d in drafts]
    max_k = max(num_drafts, default=0)
    constrained = [b for b, r in enumerate(requests) if r.guide is not None] if constrain else []
    if max_k == 0 and not constrained and all(_plain_greedy(r) for r in requests):
        return _plain_greedy_metadata(requests, device)
    errors: dict[str, Exception] = {}
    temperature, top_k, top_p, min_p, greedy, decided = [], [], [], [], [], []
    rep, freq, pres = [], [], []
    token_rows = _TokenRows()
    logprob_rows, max_logprobs = [], 0
    first_rows, draft_offsets, draft_request, draft_position, row_slot = [], [], [], [], []
    num_rows = sum(num_drafts) + len(requests)
    bitmask = xgrammar.allocate_token_bitmask(num_rows, vocab_size) if constrained else None
    grammar_rows: list[int] = []
    guided: list[tuple[Guide, int, list[int]]] = []  # (guide, first row, drafts) of each constrained request
    unseeded: list[int] = []  # request indices drawing from the engine's generator
    seeded_rows, seed_keys, output_index, seeded_request = [], [], [], []  # per row of a seeded request
    row = 0
    for b, (request, draft) in enumerate(zip(requests, drafts)):
        k = len(draft)
        first_rows.append(row)
        draft_offsets.append(len(draft_request))
        draft_request += [b] * k
        draft_position += range(k)
        row_slot += range(b * (max_k + 1), b * (max_k + 1) + k + 1)
        p = request.params
        try:
            mine = _token_rows(request, draft, row, vocab_size)
            if bitmask is not None and request.guide is not None:
                guided.append((request.guide, row, draft))
                grammar_rows += range(row, row + k + 1)
            rows = _Rows(p.temperature if not p.greedy else 1.0, p.top_k, p.top_p, p.min_p, p.greedy)
            penalties = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        except Exception as e:
            if is_fatal(e):
                raise
            errors[request.request_id] = e
            rows, penalties, mine = _Rows(), (1.0, 0.0, 0.0), _TokenRows()
            grammar_rows = [r for r in grammar_rows if r < row]
            guided = [g for g in guided if g[1] < row]
        token_rows.extend(mine)
        if p.logprobs is not None and request.request_id not in errors:
            logprob_rows += range(row, row + k + 1)
            max_logprobs = max(max_logprobs, p.logprobs)
        for _ in range(k + 1):
            temperature.append(rows.temperature)
            top_k.append(rows.top_k if rows.top_k > 0 else vocab_size)
            top_p.append(rows.top_p)
            min_p.append(rows.min_p)
            rep.append(penalties[0])
            freq.append(penalties[1])
            pres.append(penalties[2])
        greedy.append(rows.greedy)
        keyed = not rows.greedy and p.seed is not None
        decided.append(rows.greedy or keyed)
        if keyed:
            first = request.num_output_tokens + request.num_pending_tokens + ahead
            seeded_rows += range(row, row + k + 1)
            seed_keys += [seed_key(p.seed)] * (k + 1)
            output_index += range(first, first + k + 1)
            seeded_request += [b] * (k + 1)
        elif not rows.greedy:
            unseeded.append(b)
        row += k + 1
    if guided:
        fill_masks(bitmask, guided)
    # the engine's draws: k_b for the draft tokens, then the last token's, per unseeded sampled request
    uniform_drafts = torch.zeros(len(draft_request))
    uniform_last = torch.zeros(len(requests))
    pooled = torch.rand(sum(num_drafts[b] + 1 for b in unseeded), generator=generator)
    at = 0
    for b in unseeded:
        k = num_drafts[b]
        uniform_drafts[draft_offsets[b] : draft_offsets[b] + k] = pooled[at : at + k]
        uniform_last[b] = pooled[at + k]
        at += k + 1

    filters_top = any(k < vocab_size for k in top_k) or any(t < 1.0 for t in top_p)
    has_penalties = any(r != 1.0 for r in rep) or any(freq) or any(pres)
    # every list goes up in one copy per dtype; the fields are views of it
    ints = _Packed(torch.int64)
    floats = _Packed(torch.float32)
    i_greedy, i_decided, i_first, i_k, i_offset, i_drafts, i_request, i_position, i_slot = (
        ints.add(v) for v in (greedy, decided, first_rows, num_drafts, draft_offsets, [t for d in drafts for t in d],
                              draft_request, draft_position, row_slot))
    i_seeded = [ints.add(v) for v in (seeded_rows, seed_keys, output_index, seeded_request)] if seeded_rows else None
    i_top_k = ints.add(top_k) if filters_top else None
    t = token_rows
    i_penalty_lists = [ints.add(v) for v in (t.output_rows, t.output_tokens, t.prompt_rows, t.prompt_tokens)] \
        if has_penalties else None
    i_banned = [ints.add(t.banned_rows), ints.add(t.banned_tokens)] if t.banned_rows else None
    f_temperature, f_u_drafts, f_u_last = (floats.add(v) for v in (temperature, uniform_drafts.tolist(), uniform_last.tolist()))
    f_top_p = floats.add(top_p) if filters_top else None
    f_min_p = floats.add(min_p) if any(m > 0 for m in min_p) else None
    f_penalties = [floats.add(v) for v in (rep, freq, pres)] if has_penalties else None
    ints_t, floats_t = ints.upload(device), floats.upload(device)
    seeded_keys = None
    if i_seeded is not None:
        output_index_t = ints_t[i_seeded[2]]
        if position_offsets is not None:
            output_index_t = output_index_t + position_offsets[ints_t[i_seeded[3]]]
        seeded_keys = row_keys(ints_t[i_seeded[1]], output_index_t)
    return SamplingMetadata(
        requests=requests,
        num_drafts=num_drafts,
        errors=errors,
        logprob_rows=logprob_rows,
        max_logprobs=max_logprobs,
        all_greedy=all(greedy),
        any_greedy=any(greedy),
        any_drawn=bool(unseeded),
        max_k=max_k,
        greedy=ints_t[i_greedy] != 0,
        decided=ints_t[i_decided] != 0,
        first_row=ints_t[i_first],
        num_drafts_t=ints_t[i_k],
        draft_offset=ints_t[i_offset],
        draft_token_ids=ints_t[i_drafts],
        draft_request=ints_t[i_request],
        draft_position=ints_t[i_position],
        row_slot=ints_t[i_slot],
        temperature=floats_t[f_temperature],
        top_k=ints_t[i_top_k] if filters_top else None,
        top_p=floats_t[f_top_p] if filters_top else None,
        min_p=floats_t[f_min_p] if f_min_p is not None else None,
        penalties=Penalties(
            *(floats_t[i] for i in f_penalties), *(ints_t[i] for i in i_penalty_lists),
        ) if has_penalties else None,
        banned_rows=ints_t[i_banned[0]] if i_banned else None,
        banned_tokens=ints_t[i_banned[1]] if i_banned else None,
        uniform_drafts=floats_t[f_u_drafts],
        uniform_last=floats_t[f_u_last],
        seeded_rows=ints_t[i_seeded[0]] if i_seeded is not None else None,
        seeded_keys=seeded_keys,
        grammar_bitmask=on_device(bitmask, device, torch.int32) if grammar_rows else None,
        grammar_rows=None if len(grammar_rows) == num_rows else grammar_rows,
    )


def _plain_greedy(request: Request) -> bool:
    """Its token is the argmax of the raw logits: nothing to penalise, mask or report."""
    p = request.params
    return (request.guide is None and p.greedy and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and request.num_output_tokens >= p.min_tokens and p.logprobs is None)


def _plain_greedy_metadata(requests: list[Request], device: torch.device) -> SamplingMetadata:
    """A step of plain greedy requests without drafts (the common decode step), built without a
    pass over its rows."""
    n = len(requests)
    rows = torch.arange(n, device=device)
    none = torch.zeros(0, dtype=torch.int64, device=device)
    return SamplingMetadata(
        requests=requests, num_drafts=[0] * n, errors={}, logprob_rows=[], max_logprobs=0,
        all_greedy=True, any_greedy=n > 0, any_drawn=False, max_k=0,
        greedy=torch.ones(n, dtype=torch.bool, device=device), decided=torch.ones(n, dtype=torch.bool, device=device),
        first_row=rows, num_drafts_t=torch.zeros_like(rows),
        draft_offset=torch.zeros_like(rows), draft_token_ids=none, draft_request=none, draft_position=none,
        row_slot=rows, temperature=torch.ones(n, device=device), top_k=None, top_p=None, min_p=None,
        penalties=None, banned_rows=None, banned_tokens=None,
        uniform_drafts=torch.zeros(0, device=device), uniform_last=torch.zeros(n, device=device),
        seeded_rows=None, seeded_keys=None,
    )
