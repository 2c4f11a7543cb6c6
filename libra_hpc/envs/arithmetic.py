"""Arithmetic word problems solved with a calculator / Python tool in the sandbox.

A problem is a chain of 1..6 steps on a stock of items (``tasks.arithmetic``): it starts
with ``a × b`` (three-digit numbers: worth a tool call), and each further step adds a
delivery (``+ c × d``), a sale (``- e``), an equal share (``/ f``, f divides the stock) or a
growth (``× g``). A careful solver makes one call per step, chaining each result into the
next. Reward: 1 for the exact final number in ``<answer>...</answer>``, else 0.
A prompt's ``meta["kind"]`` is its number of steps (``"3-step"``).

Both tools run in the sandbox through the orchestrator (resource ``cpu``): ``calculator``
evaluates one arithmetic expression (numbers and operators only; anything else is an
``Error:`` line the model reads), ``python`` runs a snippet and returns what it prints.
"""

from __future__ import annotations

import random
import re
from typing import Any

from libra_hpc.envs.task import Prompt, Task, make_splits
from libra_hpc.envs.toolcall import ParsedCall, ToolDef

SYSTEM = ("You solve arithmetic word problems. Use the calculator or python tool for every computation, one step "
          "at a time, and give the final number as <answer>NUMBER</answer>.")

TOOLS = (
    ToolDef("calculator", "Evaluate one arithmetic expression (numbers, + - * / // % ** and parentheses).",
            {"expression": "the expression, e.g. 12 * (3 + 4)"}),
    ToolDef("python", "Run a Python snippet and return what it prints.", {"code": "Python source; print the result"}),
)

CALCULATOR = """\
import ast
expression = {expression!r}
ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop)
try:
    tree = ast.parse(expression.strip(), mode="eval")
    for node in ast.walk(tree):
        if not (isinstance(node, ALLOWED) or (isinstance(node, ast.Constant) and type(node.value) in (int, float))):
            raise ValueError(f"only numbers, operators and parentheses are allowed, not {{type(node).__name__}}")
    value = eval(compile(tree, "<calculator>", "eval"), {{"__builtins__": {{}}}})
    print(int(value) if isinstance(value, float) and value.is_integer() else value)
except Exception as err:
    print(f"Error: {{type(err).__name__}}: {{err}}")
"""

NAMES = ("Ada", "Bruno", "Chen", "Dara", "Emeka", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kira", "Luis", "Mira",
         "Nils", "Oona", "Pavel", "Quinn", "Rosa", "Sami", "Tariq", "Uma", "Vera", "Wen", "Yusuf", "Zoe")
ITEMS = ("apples", "bolts", "candles", "lamps", "notebooks", "oranges", "pencils", "tiles", "toys", "valves")
PLACES = ("warehouse", "depot", "shop", "workshop", "market stall", "storeroom")


def _number(text: str) -> float | None:
    """A number written by a model or a tool: ``1,234``, ``$56.0``, ``78.`` ; None if none."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    try:
        return float(cleaned)
    except ValueError:
        return None


def generate(seed: int, index: int, min_steps: int, max_steps: int) -> Prompt:
    """Problem ``index`` of the stream seeded by ``seed`` (the same at any split size)."""
    rng = random.Random(f"arithmetic/{seed}/{index}")
    name, items, place = rng.choice(NAMES), rng.choice(ITEMS), rng.choice(PLACES)
    a, b = rng.randint(12, 240), rng.randint(11, 99)
    value = a * b
    sentences = [f"{name}'s {place} holds {a} crates with {b} {items} each."]
    steps = [f"{a} * {b}"]
    for _ in range(rng.randint(min_steps, max_steps) - 1):
        op = rng.choice(("add", "sub", "div", "mul"))
        divisors = [f for f in range(3, 40) if value % f == 0 and value // f >= 50]
        if op == "div" and not divisors:
            op = "sub"
        if op == "add":
            c, d = rng.randint(3, 60), rng.randint(11, 99)
            sentences.append(f"A delivery brings {c} more crates of {d} {items} each.")
            steps.append(f"{{v}} + {c} * {d}")
            value += c * d
        elif op == "sub":
            e = rng.randint(7, max(8, value // 3))
            sentences.append(f"Then {e} {items} are sold.")
            steps.append(f"{{v}} - {e}")
            value -= e
        elif op == "div":
            f = rng.choice(divisors)
            sentences.append(f"The {items} are shared equally among {f} stores; from now on count one store's share.")
            steps.append(f"{{v}} / {f}")
            value //= f
        else:
            g = rng.randint(2, 9)
            sentences.append(f"That stock then grows {g}-fold.")
            steps.append(f"{{v}} * {g}")
            value *= g
    sentences.append(f"How many {items} are there at the end?")
    return Prompt(f"arith-{seed}-{index}", " ".join(sentences), str(value),
                  {"steps": tuple(steps), "kind": f"{len(steps)}-step"})


class ArithmeticTask(Task):
    """``tasks.arithmetic``: see the module docstring."""

    name = "arithmetic"
    system = SYSTEM
    tools = TOOLS

    def __init__(self, *, seed: int = 0, train_prompts: int = 2000, heldout_prompts: int = 300, min_steps: int = 1,
                 max_steps: int = 4, max_turns: int = 10):
        if not 1 <= min_steps <= max_steps:
            raise ValueError(f"tasks.arithmetic: need 1 <= min_steps ({min_steps}) <= max_steps ({max_steps})")
        self.max_turns = max_turns
        self.splits = make_splits(lambda i: generate(seed, i, min_steps, max_steps), train_prompts, heldout_prompts)

    def payload(self, call: ParsedCall) -> Any:
        if call.name == "calculator":
            return {"code": CALCULATOR.format(expression=str(call.arguments["expression"])), "tool": "calculator"}
        return {"code": str(call.arguments["code"]), "tool": "python"}

    def verify(self, prompt: Prompt, answer: str | None) -> float:
        got = None if answer is None else _number(answer)
        return float(got is not None and abs(got - float(prompt.answer)) < 1e-9)


def last_number(text: str) -> str | None:
    """The last number in a tool output (what a solver chains into its next step)."""
    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    return found[-1] if found else None
