"""The scheduler with batches in flight (pipeline parallelism): a busy request is neither
scheduled nor preempted, and `max_requests` splits the running requests into batches."""
import pytest

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


def _flood(scheduler: Scheduler, n: int, prompt_len: int, priority: int) -> list[Request]:
    flood = [Request(f"low{i}", list(range(prompt_len)), SamplingParams(max_tokens=8, priority=priority))
             for i in range(n)]
    for r in flood:
        scheduler.add(r)
    return flood


def _step(batch) -> None:
    """What the engine does with a step's tokens, as far as the scheduler sees it."""
    for r, n in zip(batch.requests, batch.num_scheduled_tokens):
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(7)


@pytest.mark.parametrize("priority", [0, -1])
def test_a_better_priority_is_not_queued_behind_a_flood(priority):
    """32 requests of priority 0 arrive, then one of `priority`: at -1 it is admitted at the next
    step with its whole prompt, ahead of 28 requests that came first and of the admitted ones'
    prompt chunks; at 0 (one priority for all) it waits its turn."""
    scheduler = Scheduler(BlockManager(1024, 4), max_num_seqs=64, max_num_batched_tokens=128)
    flood = _flood(scheduler, 32, 40, priority=0)
    _step(scheduler.schedule())  # admits 3 requests and a chunk of a 4th
    urgent = Request("urgent", list(range(100, 120)), SamplingParams(max_tokens=8, priority=priority))
    scheduler.add(urgent)
    batch = scheduler.schedule()
    if priority < 0:
        assert batch.requests[0] is urgent and batch.num_scheduled_tokens[0] == 20
        assert list(scheduler.waiting) == flood[len(flood) - len(scheduler.waiting):]  # the rest in order
    else:
        assert urgent not in batch.requests and scheduler.waiting[-1] is urgent


def test_the_worst_priority_is_preempted_first_and_waits_at_the_head_of_its_priority():
    """Out of blocks, `c` preempts `b` (priority 5), not itself, the newest; `b` waits behind the
    waiting request of priority 0 and ahead of one of its own priority that came before."""
    scheduler = Scheduler(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=1024)
    requests = {n: Request(n, list(range(4)), SamplingParams(max_tokens=50, priority=p)) for n, p in zip("abc", (0, 5, 0))}
    for r in requests.values():
        scheduler.add(r)
    _step(scheduler.schedule())  # one full block each (one left); the next token needs a second
    later = [Request("d", [1], SamplingParams(priority=5)), Request("e", [1], SamplingParams(priority=0))]
    for r in later:
        scheduler.add(r)
    assert [r.request_id for r in scheduler.waiting] == ["e", "d"]
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.preempted] == ["b"]
    assert [r.request_id for r in batch.requests] == ["a", "c"]
    assert [r.request_id for r in scheduler.waiting] == ["e", "b", "d"]
