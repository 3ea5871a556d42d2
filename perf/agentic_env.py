"""Local environments for the agentic benchmark (perf/bench_agentic.py): each is a session of an
agent loop whose every turn re-sends the whole conversation, as agents do.

- `CodeEditSession`: a source file (held-out code) to edit; each turn asks for one edit and the
  whole file back; the environment takes the answer as the new file, compiles it and reports.
- `ToolSession`: tools described in the system prompt; the model answers with a JSON call; the
  environment runs it against a local, deterministic store and returns the JSON result; the next
  question follows.
- `ChatSession`: held-out chat requests in one conversation (plain chat, little repetition to exploit).

Everything is deterministic given the model's answers (greedy decoding makes those reproducible).
"""
from __future__ import annotations

import json
import random
import re

from perf.prompts import heldout_texts
from scripts.chat_prompts import HELDOUT, chat

CODE_SYSTEM = ("You are a coding assistant. When asked to change a file, reply with the whole changed file in "
               "one ```python block and nothing else.")
TOOL_SYSTEM = """You can call these tools. Reply with one JSON object {"tool": name, "arguments": {...}} and nothing else.
- get_order {"order_id": str}: an order's status, items and customer id
- get_customer {"customer_id": str}: a customer's name, email and tier
- list_orders {"customer_id": str}: the ids of a customer's orders
- refund {"order_id": str, "amount": float}: refund part of an order"""


class CodeEditSession:
    def __init__(self, seed: int, turns: int = 3, min_lines: int = 12, max_lines: int = 20):
        rng = random.Random(seed)
        texts = [t for t in heldout_texts() if len(re.findall(r"^def \w+", t, re.M)) >= 2]
        text = rng.choice(texts)
        starts = [m.start() for m in re.finditer(r"^def \w+", text, re.M)]
        lines = text[rng.choice(starts):].splitlines()
        self.file = "\n".join(lines[: rng.randint(min_lines, max_lines)]).rstrip() + "\n"
        self.names = re.findall(r"^\s*def (\w+)", self.file, re.M) or ["main"]
        self.turns, self.turn = turns, 0
        self.messages = [{"role": "system", "content": CODE_SYSTEM},
                         {"role": "user", "content": f"Here is utils.py:\n```python\n{self.file}```\n{self.instruction()}"}]
        self.max_tokens = 64  # set by the benchmark from the file's length in tokens

    def instruction(self) -> str:
        name = self.names[self.turn % len(self.names)]
        return [f"Rename the function `{name}` to `{name}_v2` everywhere.",
                f"Add a one-line comment above `def {name}` saying what it does.",
                f"Add the type hint `-> object` to `def {name}`.",
                "Replace every tab with four spaces and remove trailing whitespace."][self.turn % 4]

    def reply(self, answer: str) -> bool:
        """Take the model's answer; False when the session is over."""
        self.messages.append({"role": "assistant", "content": answer})
        self.turn += 1
        match = re.search(r"```(?:python)?\n(.*?)(?:```|$)", answer, re.S)
        code = match.group(1) if match else answer
        try:
            compile(code, "utils.py", "exec")
            self.file, report = code, f"utils.py saved ({code.count(chr(10))} lines); tests passed."
        except SyntaxError as e:
            report = f"utils.py not saved: SyntaxError at line {e.lineno}: {e.msg}. The file is unchanged."
        if self.turn >= self.turns:
            return False
        self.messages.append({"role": "user", "content": f"{report}\n{self.instruction()}"})
        return True


class ToolSession:
    QUESTIONS = ["What is the status of order {order}?", "Who placed order {order}? Give their email.",
                 "List the orders of customer {customer}.", "Refund 10.5 on order {order}.",
                 "What tier is customer {customer}?", "What items are in order {order}?"]

    def __init__(self, seed: int, turns: int = 6):
        rng = random.Random(seed)
        self.orders = {f"A{rng.randrange(1000, 9999)}": f"C{rng.randrange(100, 999)}" for _ in range(4)}
        self.rng, self.turns, self.turn = rng, turns, 0
        self.messages = [{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": self.question()}]
        self.max_tokens = 96

    def question(self) -> str:
        order = self.rng.choice(sorted(self.orders))
        return self.rng.choice(self.QUESTIONS).format(order=order, customer=self.orders[order])

    def run_tool(self, call: dict) -> dict:
        args = call.get("arguments") if isinstance(call.get("arguments"), dict) else {}
        tool, order, customer = call.get("tool"), str(args.get("order_id", "")), str(args.get("customer_id", ""))
        if tool == "get_order" and order in self.orders:
            return {"order_id": order, "status": "shipped", "customer_id": self.orders[order],
                    "items": [{"sku": f"SKU-{order[1:]}-{i}", "quantity": i + 1, "price": 9.99 + i} for i in range(3)]}
        if tool == "get_customer" and customer in self.orders.values():
            return {"customer_id": customer, "name": f"Customer {customer}", "email": f"{customer.lower()}@example.com",
                    "tier": "gold"}
        if tool == "list_orders":
            return {"customer_id": customer, "order_ids": sorted(o for o, c in self.orders.items() if c == customer)}
        if tool == "refund" and order in self.orders:
            return {"order_id": order, "refunded": args.get("amount", 0), "status": "refund_pending"}
        return {"error": f"unknown tool or arguments: {json.dumps(call)[:200]}"}

    def reply(self, answer: str) -> bool:
        self.messages.append({"role": "assistant", "content": answer})
        self.turn += 1
        match = re.search(r"\{.*\}", answer, re.S)
        try:
            call = json.loads(match.group(0)) if match else {}
        except json.JSONDecodeError:
            call = {}
        result = self.run_tool(call if isinstance(call, dict) else {})
        if self.turn >= self.turns:
            return False
        content = json.dumps(result)
        if self.turn % 2 == 0:  # every other turn the tool's result is followed by the next question
            content += "\n" + self.question()
        self.messages.append({"role": "tool", "content": content})
        return True


class ChatSession:
    """Held-out chat requests, one after another in one conversation (the history re-sent)."""

    def __init__(self, seed: int, turns: int = 3):
        self.questions = [HELDOUT[(seed * 7 + i) % len(HELDOUT)] for i in range(turns)]
        self.turns, self.turn = turns, 0
        self.messages = chat(self.questions[0])
        self.max_tokens = 64

    def reply(self, answer: str) -> bool:
        self.messages.append({"role": "assistant", "content": answer})
        self.turn += 1
        if self.turn >= self.turns:
            return False
        self.messages += chat(self.questions[self.turn])
        return True


WORKLOADS = {"code-edit": CodeEditSession, "tools": ToolSession, "chat": ChatSession}
