"""Question answering by searching a document collection the project generates.

The collection (seeded, ``tasks.search.entities`` people): one document per fictional
person (birth town, birth year, employer), per company (headquarters town, founding year)
and per town (river, mayor). Questions chain 1..3 documents:

- 1 hop: "In which year was Alvo Brenn born?" (the person's document; also the town they
  were born in, the company they work for, asked two ways, their job);
- 2 hops: "On which river lies the town where Alvo Brenn was born?" (person → town);
- 3 hops: "On which river lies the town where the company Alvo Brenn works for is
  headquartered?" (person → company → town).

The ``search`` tool is keyword search: the documents that contain every query word (stop
words aside), best ``top_k`` first. A query that matches nothing returns ``No results``
(status ``failure``); a match on the wrong documents is a miss the model answers with
another search. It runs in-process on the orchestrator's ``search`` resource
(:class:`SearchRunner`, a runner like the sandbox's). Reward: 1 for the normalised exact
answer in ``<answer>...</answer>`` (case, spaces, punctuation and a leading "the" ignored).

Each prompt's ``meta["kind"]`` names what it asks (``SEARCH_KINDS``, in the schema:
libra_hpc/config_learning.py): the scripted solver's
``guess_on`` picks kinds by it, and evaluations break success down by it.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from libra_hpc.config_learning import SEARCH_KINDS
from libra_hpc.envs.task import Prompt, Task, make_splits
from libra_hpc.envs.toolcall import ParsedCall, ToolDef

SYSTEM = ("You answer questions about people, companies and towns by searching a document collection with the "
          "search tool. A search returns the passages that contain every word of the query. Give the final "
          "answer as <answer>ANSWER</answer>.")

TOOLS = (ToolDef("search", "Keyword search over the document collection; returns the best passages.",
                 {"query": "words that must all appear in a passage"}, resource="search"),)

STOP = frozenset("a an and at by did does for from in is of on the to was were what where which who whom whose "
                 "with year".split())
SYLLABLES = ("al", "bren", "cor", "dal", "ev", "fen", "gar", "hol", "is", "jor", "kel", "lum", "mar", "nor", "os",
             "pel", "quin", "ros", "sel", "tor", "ul", "vel", "wyn", "yor", "zan")
RIVERS = ("Amber", "Brisk", "Cold", "Dun", "Elder", "Fallow", "Grey", "Hollow", "Iron", "Jade", "Kestrel", "Long")
JOBS = ("engineer", "teacher", "chemist", "pilot", "baker", "architect", "nurse", "lawyer", "painter", "farmer")
SUFFIXES = ("Works", "Labs", "Foods", "Textiles", "Mining", "Freight", "Optics", "Press")


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def normalise(text: str) -> str:
    """Answer comparison form: lower case, punctuation dropped, spaces collapsed, no leading 'the'."""
    out = " ".join(words(text))
    return out[4:] if out.startswith("the ") else out


@dataclass(frozen=True)
class World:
    """The generated facts and their documents."""

    people: dict[str, dict[str, Any]]
    companies: dict[str, dict[str, Any]]
    towns: dict[str, dict[str, Any]]
    documents: tuple[str, ...]


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def build_world(seed: int, entities: int) -> World:
    rng = random.Random(f"search-world/{seed}")
    unique: set[str] = set()

    def fresh(make):
        while (name := make()) in unique or name.lower() in STOP:
            pass
        unique.add(name)
        return name

    towns = {fresh(lambda: _name(rng, 2) + rng.choice(("ford", "by", "ton", "wick"))): {}
             for _ in range(max(6, entities // 10))}
    companies = {fresh(lambda: f"{_name(rng, 2)} {rng.choice(SUFFIXES)}"): {} for _ in range(max(6, entities // 5))}
    people = {fresh(lambda: f"{_name(rng, 2)} {_name(rng, 2)}"): {} for _ in range(entities)}
    town_names, company_names, person_names = list(towns), list(companies), list(people)
    for person in person_names:
        people[person] = {"town": rng.choice(town_names), "year": rng.randint(1931, 1999),
                          "company": rng.choice(company_names), "job": rng.choice(JOBS)}
    for company in company_names:
        companies[company] = {"town": rng.choice(town_names), "year": rng.randint(1850, 2010),
                              "founder": rng.choice(person_names)}
    for town in town_names:
        towns[town] = {"river": rng.choice(RIVERS), "mayor": rng.choice(person_names),
                       "population": rng.randint(2, 900) * 100}
    docs = [f"{p} was born in {f['town']} in {f['year']}. {p} works for {f['company']} as a {f['job']}."
            for p, f in people.items()]
    docs += [f"{c} is headquartered in {f['town']}. It was founded in {f['year']} by {f['founder']}."
             for c, f in companies.items()]
    docs += [f"{t} is a town on the {f['river']} river with {f['population']} inhabitants. Its mayor is {f['mayor']}."
             for t, f in towns.items()]
    return World(people, companies, towns, tuple(docs))


def generate(world: World, seed: int, index: int, max_hops: int, kinds: Sequence[str] | None = None) -> Prompt:
    """Question ``index`` of ``seed``: a person, then a kind (one of ``kinds``, or a number
    of documents uniform in 1..``max_hops`` and a kind of it), then its text and answer."""
    rng = random.Random(f"search-q/{seed}/{index}")
    person = rng.choice(list(world.people))
    facts = world.people[person]
    chosen = rng.choice(list(kinds)) if kinds else None
    hops = SEARCH_KINDS[chosen] if chosen else rng.randint(1, max_hops)
    if hops == 1:
        kind = chosen or rng.choice([k for k, docs in SEARCH_KINDS.items() if docs == 1])
        text = {"year": f"In which year was {person} born?", "company": f"Which company does {person} work for?",
                "employer": f"Which firm employs {person}?", "town": f"In which town was {person} born?",
                "job": f"What does {person} work as?"}[kind]
        answer, chain = str(facts["company" if kind == "employer" else kind]), (person,)
    elif hops == 2:
        if (chosen or ("river" if rng.random() < 0.5 else "founded")) == "river":
            text, answer = f"On which river lies the town where {person} was born?", world.towns[facts["town"]]["river"]
            kind, chain = "river", (person, facts["town"])
        else:
            text = f"In which year was the company {person} works for founded?"
            answer, chain = str(world.companies[facts["company"]]["year"]), (person, facts["company"])
            kind = "founded"
    else:
        company = facts["company"]
        town = world.companies[company]["town"]
        text = f"On which river lies the town where the company {person} works for is headquartered?"
        kind, answer, chain = "hq-river", world.towns[town]["river"], (person, company, town)
    return Prompt(f"search-{seed}-{index}", text, answer,
                  {"hops": len(chain), "chain": chain, "kind": kind, "entity": person})


class SearchIndex:
    """Conjunctive keyword search ranked by summed inverse document frequency over length."""

    def __init__(self, documents: tuple[str, ...]):
        self.documents = documents
        self._terms = [set(words(d)) for d in documents]
        df = Counter(t for terms in self._terms for t in terms)
        self._idf = {t: math.log(len(documents) / n) + 1.0 for t, n in df.items()}

    def search(self, query: str, top_k: int) -> list[str]:
        terms = [t for t in words(query) if t not in STOP]
        if not terms:
            return []
        hits = [i for i, doc in enumerate(self._terms) if all(t in doc for t in terms)]
        score = lambda i: sum(self._idf[t] for t in terms) / math.sqrt(len(self._terms[i]))  # noqa: E731
        return [self.documents[i] for i in sorted(hits, key=lambda i: (-score(i), i))[:top_k]]


class SearchRunner:
    """The orchestrator's runner of the ``search`` resource: ``run(unit, {"query": ...})``."""

    def __init__(self, index: SearchIndex, top_k: int):
        self.index, self.top_k = index, top_k

    def run(self, unit: int, payload: dict[str, Any]) -> dict[str, str]:
        query = str(payload["query"])
        found = self.index.search(query, self.top_k)
        if not found:
            return {"output": f"No results for {query!r}: no passage contains all of its words. "
                              "Try fewer or different words.", "status": "failure"}
        return {"output": "\n".join(f"[{i + 1}] {doc}" for i, doc in enumerate(found)), "status": "success"}


class SearchTask(Task):
    """``tasks.search``: see the module docstring."""

    name = "search"
    system = SYSTEM
    tools = TOOLS

    def __init__(self, *, seed: int = 0, entities: int = 400, train_prompts: int = 2000, heldout_prompts: int = 300,
                 max_hops: int = 3, top_k: int = 2, max_turns: int = 10, kinds: Sequence[str] | None = None):
        unknown = sorted(set(kinds or ()) - set(SEARCH_KINDS))
        if unknown:
            raise ValueError(f"search task: unknown question kinds {unknown} (kinds: {sorted(SEARCH_KINDS)})")
        self.max_turns = max_turns
        self.world = build_world(seed, entities)
        self.index = SearchIndex(self.world.documents)
        self.top_k = top_k
        self.splits = make_splits(lambda i: generate(self.world, seed, i, max_hops, kinds), train_prompts, heldout_prompts)

    def payload(self, call: ParsedCall) -> Any:
        return {"query": str(call.arguments["query"])}

    def runners(self) -> dict[str, Any]:
        return {"search": SearchRunner(self.index, self.top_k)}

    def verify(self, prompt: Prompt, answer: str | None) -> float:
        return float(answer is not None and normalise(answer) == normalise(prompt.answer))
