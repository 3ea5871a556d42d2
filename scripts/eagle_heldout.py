"""The held-out evaluation of an EAGLE head (scripts/train_eagle_draft.py): the float32 target's
sampled and greedy answers to the held-out prompts, step-1 agreement and acceptance, and chained
drafting's accepted tokens for the head and a standalone draft."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from scripts.chat_prompts import HELDOUT_CHAT
from scripts.default_target import REPO_ROOT, target_hidden
from scripts.eagle_head import EagleHead

OUT = REPO_ROOT / ".cache" / "eagle_draft"
TEMPERATURE = 0.7
MAX_ANSWER_TOKENS = 160


def target_answers(tok, target, prompts: list[list[int]], batch: int = 8, max_new_tokens: int = MAX_ANSWER_TOKENS,
                   **sampling) -> list[list[int]]:
    """The float32 target's answers (left-padded batches; cut after the first eos): greedy, or as
    `sampling` (generate's do_sample, temperature, ...) says."""
    answers = []
    for b in range(0, len(prompts), batch):
        rows = prompts[b:b + batch]
        width = max(map(len, rows))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in rows], device=target.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=target.device)
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              pad_token_id=tok.pad_token_id, **({"do_sample": False} | sampling))
        for row in out[:, width:].tolist():
            answers.append(row[:row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return answers


def target_item(target, ids: list[int], start: int, token_ids: torch.Tensor | None, feature_layers: list[int]) -> dict:
    """A sequence with the float32 target's features (as the feature pool holds them: the residual stream
    after each of feature_layers and the final normed hidden state, concatenated) and argmaxes at every
    position, and (given token_ids) its T = 0.7 probabilities of the draft tokens."""
    input_ids = torch.tensor([ids], device=target.device)
    hidden, layers = target_hidden(target, input_ids, feature_layers)
    hidden = hidden[0]
    logits = target.lm_head(hidden)
    p = None if token_ids is None else F.softmax(logits / TEMPERATURE, -1)[:, token_ids].half()
    features = hidden if layers is None else torch.cat([layers[0].flatten(1), hidden], -1)
    return {"ids": input_ids[0], "start": start, "hidden": features, "argmax": logits.argmax(-1), "p": p}


@torch.inference_mode()
def heldout_sets(tok, target, data: dict, token_ids: torch.Tensor,
                 feature_layers: list[int]) -> tuple[list[dict], list[dict]]:
    """(sampled, greedy) held-out items, chat prompts first, on the target's device; computed once into
    heldout.pt (heldout_l2-15.pt with feature_layers 2, 15)."""
    path = OUT / ("heldout.pt" if not feature_layers else f"heldout_l{'-'.join(map(str, feature_layers))}.pt")
    if path.exists():
        cached = torch.load(path)
        if torch.equal(cached["token_ids"], token_ids.cpu()) and cached.get("feature_layers", []) == feature_layers:
            return to_device(cached["sampled"], target.device), to_device(cached["greedy"], target.device)
    sampled = [target_item(target, ids, start, token_ids, feature_layers) for ids, start in data["heldout"]]
    prompts = [ids[:start] for ids, start in data["heldout"]]
    greedy = [target_item(target, p + a, len(p), None, feature_layers)
              for p, a in zip(prompts, target_answers(tok, target, prompts))]
    mismatch = sum((g["argmax"][g["start"] - 1:-1] != g["ids"][g["start"]:]).sum().item() for g in greedy)
    print(f"greedy held-out: {sum(len(g['ids']) - g['start'] for g in greedy)} answer tokens, "
          f"{mismatch} differ from the unpadded forward's argmax", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    torch.save({"token_ids": token_ids.cpu(), "feature_layers": feature_layers, "sampled": to_device(sampled, "cpu"),
                "greedy": to_device(greedy, "cpu")}, path)
    return sampled, greedy


def to_device(items: list[dict], device) -> list[dict]:
    """Held-out items with their tensors on `device`."""
    return [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in it.items()} for it in items]


def splits(items: list[dict]) -> dict[str, list[dict]]:
    chat = len(HELDOUT_CHAT)
    return {"all": items, "chat": items[:chat], "code": items[chat:]}


def answer_drafts(head: EagleHead, embed, it: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Step-1 drafting of an item's answer with true features: (the head's f^ [n, H] whose logits
    draft each answer token, the target's argmax there [n], its T = 0.7 p there [n, V'] or None)."""
    ids, j = it["ids"], slice(it["start"] - 1, len(it["ids"]) - 1)  # target positions predicting answers
    feats = head.unroll(embed(ids[None, 1:]), it["hidden"][None, :-1], 1)[0][0]  # head position t = j - 1
    return feats[it["start"] - 2:-1], it["argmax"][j], None if it["p"] is None else it["p"][j].float()


@torch.inference_mode()
def step1(head: EagleHead, embed, items: list[dict], token_ids: torch.Tensor) -> dict:
    """Greedy agreement and expected acceptance at T = 0.7 with true features, at the answer positions."""
    result = {}
    for name, subset in splits(items).items():
        agree = accept = count = 0.0
        for it in subset:
            feats, argmax, p = answer_drafts(head, embed, it)
            q_logits = head.logits(feats).float()
            agree += (token_ids[q_logits.argmax(-1)] == argmax).sum().item()
            accept += torch.minimum(p, F.softmax(q_logits / TEMPERATURE, -1)).sum().item()
            count += len(q_logits)
        result[name] = {"agreement": agree / count, "acceptance": accept / count}
    return result


@torch.inference_mode()
def head_chain(head: EagleHead, embed, it: dict, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Greedy drafts [k, N] from every head position n (N = L - 1): row d drafts ids[n + 2 + d] (-1 past
    the text), draft 1 from the true f_n, the later ones from the head's own f^ and greedy token."""
    ids = it["ids"]
    greedy = lambda feats: token_ids[head.logits(feats).argmax(-1)]
    out = head.unroll(embed(ids[None, 1:]), it["hidden"][None, :-1], k, lambda d, feats: embed(greedy(feats)))
    drafts = torch.full((k, len(ids) - 1), -1, device=ids.device)
    for d, feats in enumerate(out):
        drafts[d, :feats.shape[1]] = greedy(feats[0])
    return drafts


@torch.inference_mode()
def standalone_chain(draft, it: dict, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """The standalone draft's greedy drafts [k, N] from every position j (N = L - 1): row d drafts
    ids[j + 1 + d]; a chain stops (drafts -1) after its first miss, which decides its acceptance."""
    from transformers import DynamicCache

    ids = it["ids"]
    out = draft(ids[None], use_cache=True)
    drafts = torch.full((k, len(ids) - 1), -1, device=ids.device)
    drafts[0] = token_ids[out.logits[0, :-1].argmax(-1)]
    for j in range(it["start"] - 1, len(ids) - k):
        cache = DynamicCache([(layer.keys[..., :j + 1, :], layer.values[..., :j + 1, :]) for layer in out.cache.layers])
        for depth in range(1, k):
            if drafts[depth - 1, j] != ids[j + depth]:
                break
            logits = draft(drafts[depth - 1, j].view(1, 1), cache=cache, use_cache=True).logits[0, -1]
            drafts[depth, j] = token_ids[logits.argmax()]
    return drafts


def chain_metrics(items: list[dict], drafts: list[torch.Tensor], offset: int, k: int) -> dict:
    """Expected accepted drafts per verification (0..k) under greedy, and the acceptance rate at each
    depth given the earlier ones accepted; drafts[i][d, n] drafts ids[n + offset + d] (offset 1 for a
    standalone draft's position j = n, 2 for the head's position t = n), from the answer positions."""
    result = {}
    chat = len(HELDOUT_CHAT)
    for name, rows in {"all": slice(None), "chat": slice(0, chat), "code": slice(chat, None)}.items():
        accepted = []
        for it, d in zip(items[rows], drafts[rows]):
            first = it["start"] - 1 - (offset - 1)  # first column whose draft 1 is an answer token
            last = len(it["ids"]) - k - offset  # last column whose k drafts stay inside the text
            truth = torch.stack([it["ids"][first + offset + depth:last + offset + depth + 1] for depth in range(k)])
            accepted.append((d[:, first:last + 1] == truth).int().cumprod(0).sum(0))
        accepted = torch.cat(accepted)
        reach = [(accepted >= depth).sum().item() for depth in range(k + 1)]
        result[name] = {"expected_accepted": accepted.float().mean().item(), "positions": len(accepted),
                        "depth_rates": [reach[d + 1] / max(reach[d], 1) for d in range(k)]}
    return result


def evaluate(head, embed, sampled, greedy, token_ids, k: int, label: str) -> dict:
    result = {"step1": step1(head, embed, sampled, token_ids),
              "chain": chain_metrics(greedy, [head_chain(head, embed, it, token_ids, k) for it in greedy], 2, k)}
    print(f"held-out {label}: " + ", ".join(f"{s} {m['agreement']:.3f}/{m['acceptance']:.3f}"
                                            for s, m in result["step1"].items())
          + f" (step-1 agreement/acceptance); k={k} greedy accepted " + ", ".join(
              f"{s} {m['expected_accepted']:.3f} {[round(r, 3) for r in m['depth_rates']]}"
              for s, m in result["chain"].items()), flush=True)
    return result


def standalone(draft, token_ids: torch.Tensor, path: Path, greedy: list[dict], k: int) -> dict:
    """The saved standalone draft's step-1 figures (its train_result.json) and chained ones."""
    reported = json.loads((path / "train_result.json").read_text())["heldout"]
    chains = [standalone_chain(draft, it, token_ids, k) for it in greedy]
    return {"path": str(path), "step1_reported": reported, "chain": chain_metrics(greedy, chains, 1, k)}
