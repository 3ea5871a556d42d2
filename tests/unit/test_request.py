"""Request's token views."""
import random

from backend.core.request import Request
from backend.sampling_params import SamplingParams


def test_tokens_slice_equals_slicing_the_whole_context():
    rng = random.Random(0)
    for _ in range(2000):
        r = Request("r", [rng.randrange(100) for _ in range(rng.randint(1, 8))], SamplingParams())
        r.output_token_ids = [rng.randrange(100) for _ in range(rng.randint(0, 6))]
        r.spec.draft_token_ids = [rng.randrange(100) for _ in range(rng.randint(0, 4))]
        whole = r.prompt_token_ids + r.output_token_ids + r.spec.draft_token_ids
        start = rng.randint(0, len(whole))
        end = rng.randint(start, len(whole) + 2)
        assert r.tokens_slice(start, end) == whole[start:end]
