"""The speculation policy: which requests speculate this step, and with how many draft tokens.

    ks = policy.plan(candidates, num_running)      # before scheduling
    policy.observe_...(what the step measured)     # after it

Two measured parts decide. The ModeChooser (mode_chooser.py) says whether speculation pays at this
batch size at all, from decode-only steps' tokens per second with it and without; the
SpecController (spec_controller.py) picks k per request from its acceptance survival and the
measured forward costs. A mode's rate counts a verification by its expected yield, E(k), not the
1..k+1 tokens it happened to yield (too noisy over a few steps); steps whose drafts catch up on
what they missed while speculation was off are charged to switching it on, not to its rate.
"""
from __future__ import annotations

from backend.core.request import Request
from backend.spec.mode_chooser import ModeChooser
from backend.spec.spec_controller import SpecController


class SpeculationPolicy:
    def __init__(self, max_k: int, adaptive: bool, free_drafts: bool):
        self.adaptive = adaptive
        self.controller = SpecController(max_k, adaptive, free_drafts)
        self.modes = ModeChooser()
        self.yield_correction = 0.0  # this step's expected minus realized verification yields
        self.catching_up = False  # this step's drafts read more than the last step's tokens ...
        self.catch_up_seconds = 0.0  # ... and what that costs beyond a usual first draft forward

    def plan(self, candidates: list[Request], num_running: int) -> list[int]:
        """k per candidate (0: it does not speculate); each one's expected yields E(0..max_k) go
        to `request.spec.expected_yield` when k adapts."""
        self.yield_correction, self.catching_up, self.catch_up_seconds = 0.0, False, 0.0
        if not candidates or (self.adaptive and not self.modes.speculate(num_running)):
            return [0] * len(candidates)
        ks = self.controller.plan(candidates)
        if self.adaptive:
            for r, expected in zip(candidates, self.controller.expected):
                r.spec.expected_yield = expected
        return ks

    def observe_verification(self, request: Request, k: int, num_accepted: int) -> None:
        expected, request.spec.expected_yield = request.spec.expected_yield, None
        if expected is not None:
            self.yield_correction += expected[k] - (num_accepted + 1)
        self.controller.observe(request, k, num_accepted)

    def observe_target_forward(self, num_tokens: int, seconds: float) -> None:
        """A decode-only target forward (prompt chunks cost per token what verification does not)."""
        self.controller.target_cost.add(num_tokens, seconds)

    def observe_draft_forward(self, index: int, num_tokens: int, num_requests: int, seconds: float) -> None:
        """The first draft forward of a step catches up on every token the draft has not seen, so
        it is costed by tokens; the others compute one token per request."""
        if index == 0:
            self.controller.draft_first_cost.add(num_tokens, seconds)
        else:
            self.controller.draft_cost.add(num_requests, seconds)

    def observe_catch_up(self, behind: int, usual: int) -> None:
        """This step's first draft forward reads `behind` tokens where `usual` would do."""
        self.catching_up = behind > 2 * usual
        first = self.controller.draft_first_cost
        if self.catching_up and first.ready:
            self.catch_up_seconds = max(first(behind) - first(usual), 0.0)

    def observe_step(self, speculating: bool, num_requests: int, num_tokens: int, seconds: float,
                     catching_up: bool = False, catch_up_seconds: float = 0.0) -> None:
        """A decode-only step: each request computed its last token and its drafts, nothing else.
        `catching_up`, `catch_up_seconds`: what that step's plan measured (observe_catch_up); with
        overlapped steps the plan of the step after it has come since."""
        if not self.adaptive:
            return
        if catching_up and not self.modes.steady(num_requests):
            # the drafts catch up on what they missed while speculation was off (or on whole
            # prompts, when speculation is new here): what switching it on costs, not its rate
            self.modes.charge_switch(num_requests, catch_up_seconds)
            return
        # with speculation on, new requests' drafts reading their prompts are part of its rate
        self.modes.observe(speculating, num_requests, num_tokens + self.yield_correction, seconds)
