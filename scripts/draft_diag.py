"""Train-set vs held-out agreement of a saved draft (is a miss under- or over-fitting?).

Agreement with the teacher's cached argmax (bfloat16 teacher, teacher.pt) on `--n` training chat
answers and code windows, beside the held-out numbers that train_default_draft reports.

    nice -n 19 python -m scripts.draft_diag .cache/default_draft/best --n 40
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from scripts.default_target import load_target
from scripts.draft_data import CACHE, SEQ_LEN, padded
from scripts.draft_model import load_draft


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok, target = load_target(torch.float32)
    draft, token_ids = load_draft(Path(args.path), target)
    data, teacher = torch.load(CACHE / "data.pt"), torch.load(CACHE / "teacher.pt")
    for split in ("chat", "code"):
        agree = count = inside = 0
        for (ids, start), t in list(zip(data[split], teacher[split]))[:args.n]:
            input_ids, mask = padded([(ids[:SEQ_LEN], start)], tok.pad_token_id)
            pred = token_ids[draft(input_ids).logits[0][mask[0]].argmax(-1)]
            top1 = t["ids"][mask[0], 0].long()
            agree += (pred == top1).sum().item()
            inside += torch.isin(top1, token_ids).sum().item()
            count += len(top1)
        print(f"train {split} ({args.n} sequences, {count} positions): agreement {agree / count:.3f}, "
              f"teacher argmax inside the draft vocabulary {inside / count:.3f}")


if __name__ == "__main__":
    main()
