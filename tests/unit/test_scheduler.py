"""The scheduler with batches in flight (pipeline parallelism): a busy request is neither
scheduled nor preempted, and `max_requests` splits the running requests into batches."""
from backend.core.block_manager import BlockManager
from backend.core.request import Request, RequestStatus
from backend.sampling_params import SamplingParams
from backend.core.scheduler import Scheduler


def _running(scheduler: Scheduler, names: str, prompt_len: int) -> dict[str, Request]:
    """Requests named by the letters of `names`, admitted and past their prompts (decoding)."""
    requests = {n: Request(n, list(range(prompt_len)), SamplingParams(max_tokens=50)) for n in names}
    for r in requests.values():
        scheduler.add(r)
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == list(names)
    for r in requests.values():
        r.num_computed_tokens = prompt_len
        r.output_token_ids.append(7)
    return requests


def test_max_requests_splits_the_running_requests_and_busy_ones_wait():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=6, max_num_batched_tokens=1024)
    _running(scheduler, "abcd", 3)
    first = scheduler.schedule(max_requests=2)
    assert [r.request_id for r in first.requests] == ["a", "b"]
    second = scheduler.schedule(busy={"a", "b"}, max_requests=2)
    assert [r.request_id for r in second.requests] == ["c", "d"]
    assert scheduler.schedule(busy={"a", "b", "c", "d"}, max_requests=2).requests == []
    new = Request("e", [1, 2], SamplingParams(max_tokens=5))
    scheduler.add(new)
    third = scheduler.schedule(busy={"a", "b", "c", "d"}, max_requests=2)
    assert [r.request_id for r in third.requests] == ["e"]  # a waiting request is admitted beside them


def test_a_request_in_flight_is_never_preempted():
    """Out of blocks, `a` preempts the newest request not in flight: `b`, not `c`."""
    scheduler = Scheduler(BlockManager(3, 4), max_num_seqs=4, max_num_batched_tokens=1024)
    requests = _running(scheduler, "abc", 4)  # one full block each; the next token needs a second
    batch = scheduler.schedule(busy={"c"})
    assert [r.request_id for r in batch.preempted] == ["b"]
    assert [r.request_id for r in batch.requests] == ["a"]
    assert requests["c"].status is RequestStatus.RUNNING and requests["c"].block_table
    assert requests["b"].status is RequestStatus.PREEMPTED and not requests["b"].block_table
