"""The cost of guided decoding, in one run: engine tok/s and the per-step mask time at batch 1, 16
and 64 with no row constrained, half of them and all of them; and the compile time of JSON
Schemas, cold and cached.

Every request generates exactly `--max-tokens` tokens (sampled, T = 1, seeded): the constrained
ones follow a JSON Schema (an array of at least 1,000 objects, each a string and an integer) that
cannot end sooner, the others ignore EOS; "all, maxLength" bounds the strings to 12 characters. Configurations alternate over
`--repeats` rounds; the best round counts. Mask time per step = the host's grammar work (filling
the rows' bitmasks: guide.fill_masks) plus applying them to the logits
(xgrammar.apply_token_bitmask_inplace), timed around those two calls.

    python -m perf.bench_guided                         # the default model, float32
    python -m perf.bench_guided --threads 1 --repeats 3 # steadier on a shared CPU
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import xgrammar

from backend.config import EngineConfig
from backend.core.grammar_compiler import GrammarCompiler
from backend.engine import LLMEngine
from backend.sample import sampler as sampler_module
from backend.sample import sampling_metadata as metadata_module
from backend.sampling_params import SamplingParams
from tests.model.test_guided_decoding import SCHEMAS  # ten shapes

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "model_repository" / "llm_engine" / "1" / "target"
LONG = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]}}
# the same with bounded strings: xgrammar expands maxLength into a bounded repetition, which is slow
# to compile and whose masks at the strings' first characters take milliseconds
BOUNDED = LONG | {"items": LONG["items"] | {"properties": {"name": {"type": "string", "maxLength": 12},
                                                            "n": {"type": "integer"}}}}
MODES = (("none", 0, LONG), ("half", 0.5, LONG), ("all", 1.0, LONG), ("all, maxLength", 1.0, BOUNDED))
PROMPTS = ["List some inventory records as JSON.", "Write data about animals.", "Give me a table of cities.",
           "Produce test records."]


class MaskTimer:
    """Seconds spent in the grammar's two calls, wrapped around the engine's own functions."""

    def __init__(self):
        self.seconds = 0.0
        metadata_module.fill_masks = self.timed(metadata_module.fill_masks)
        sampler_module.xgrammar.apply_token_bitmask_inplace = self.timed(xgrammar.apply_token_bitmask_inplace)

    def timed(self, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper


def run(engine: LLMEngine, batch: int, constrained: int, max_tokens: int, timer: MaskTimer,
        schema: dict = LONG) -> tuple[float, float]:
    """(tok/s, mask ms per step) of `batch` requests, the first `constrained` of them guided."""
    tok = engine.tokenizer
    for i in range(batch):
        prompt = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
        guided = i < constrained
        engine.add_request(prompt, SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=not guided,
            guided_decoding={"json": schema} if guided else None))
    timer.seconds, steps, tokens = 0.0, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        tokens += sum(len(o.token_ids) for o in outputs)
    wall = time.perf_counter() - start
    assert tokens == batch * max_tokens, (tokens, batch * max_tokens)
    return tokens / wall, timer.seconds / steps * 1e3


def compile_times(engine: LLMEngine) -> tuple[list[float], list[float]]:
    """Milliseconds per schema: a fresh compiler (its vocabulary read first, untimed), then again."""
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    compiler.compile({"regex": "a"})
    rounds = []
    for _ in range(2):
        times = []
        for schema in SCHEMAS:
            params = SamplingParams(guided_decoding={"json": schema})
            start = time.perf_counter()
            compiler.compile(params.guided_decoding)
            times.append((time.perf_counter() - start) * 1e3)
        rounds.append(times)
    return rounds[0], rounds[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads,
                                    max_num_seqs=max(args.batches)))
    timer = MaskTimer()
    cold, cached = compile_times(engine)
    run(engine, 4, 2, 8, timer)  # warm-up
    best: dict[tuple[int, str], tuple[float, float]] = {}
    for _ in range(args.repeats):
        for batch in args.batches:
            for name, share, schema in MODES:
                if name == "half" and batch == 1:
                    continue
                result = run(engine, batch, int(batch * share), args.max_tokens, timer, schema)
                key = (batch, name)
                if key not in best or result[0] > best[key][0]:
                    best[key] = result

    print(f"\nguided decoding cost: {Path(args.model).name}, {args.dtype}, {args.max_tokens} tokens per request, "
          f"T = 1, best of {args.repeats}")
    print(f"{'batch':>5} | {'constrained':>14} | {'tok/s':>8} | {'vs none':>7} | {'mask ms/step':>12}")
    for batch in args.batches:
        base = best[(batch, "none")][0]
        for name, _, _ in MODES:
            if (batch, name) in best:
                tps, mask = best[(batch, name)]
                print(f"{batch:>5} | {name:>14} | {tps:8.1f} | {tps / base:6.3f}x | {mask:12.3f}")
    print(f"\ncompile, {len(SCHEMAS)} JSON Schemas: cold median {statistics.median(cold):.2f} ms "
          f"(max {max(cold):.2f}), cached median {statistics.median(cached) * 1e3:.1f} us (max {max(cached) * 1e3:.1f})")


if __name__ == "__main__":
    main()
