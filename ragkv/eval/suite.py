"""The RAG question-answering suite behind `ragkv eval`: generated from templates, seeded.

Every fact is invented (people, towns, rivers, companies, inventions, numbers), so an answer can
come only from the documents. A seed fixes a finite pool of documents, one per entity, and every
item draws its documents from that pool: the same document text recurs in many items, in
different orders and subsets, as in real RAG traffic (the chunk cache's case).

Tasks:
- `single-first`, `single-middle`, `single-last`: one document states the fact; it is placed
  first, in the middle or last among unrelated documents;
- `distractor`: the other documents include near-identical facts about similar-named entities
  (siblings sharing a surname, towns sharing a stem, companies sharing a brand word);
- `two-hop`: the question needs two documents, joined by a bridge entity named in both.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

TASKS = ("single-first", "single-middle", "single-last", "distractor", "two-hop")

SYSTEM = "Answer the question using only the documents. Reply with just the answer."
# Said again at the end of the question: SmolLM2-135M follows an instruction next to where it
# answers, not one a thousand tokens back (measured: a third of the wordy answers, cut off at
# 16 tokens, became short correct ones).
ASK = " Answer in a few words."

MIN_DOCUMENTS = 4
MAX_DOCUMENTS = 10
# Two-hop items stay short: with up to ten documents SmolLM2-135M answers ~15% of them even
# with full attention, too near the floor for the eval to see a mode lose accuracy.
MAX_TWO_HOP_DOCUMENTS = 6


@dataclass(frozen=True, slots=True)
class EvalItem:
    """One question. `evidence` holds the indices into `documents` of the documents that state
    the facts needed (two for two-hop, in hop order); `bridge` is the entity joining the hops."""

    id: str
    task: str
    system: str
    documents: tuple[str, ...]
    question: str
    answer: str
    aliases: tuple[str, ...] = ()
    evidence: tuple[int, ...] = ()
    bridge: str = ""


@dataclass(frozen=True, slots=True)
class _Fact:
    question: str
    answer: str
    aliases: tuple[str, ...]
    docs: tuple[int, ...]  # pool indices of the evidence, in hop order
    bridge: str = ""


@dataclass(frozen=True, slots=True)
class _Pool:
    documents: tuple[str, ...]
    cluster: tuple[int, ...]  # per document: entities with similar names share a cluster id
    facts: tuple[_Fact, ...]  # answered by one document
    chains: tuple[_Fact, ...]  # answered by two documents


_FIRST_NAMES = (
    "Ilse", "Tomas", "Marta", "Oren", "Tamsin", "Bertil", "Edda", "Casimir", "Linnea", "Anselm",
    "Greta", "Jorund", "Wilma", "Osric", "Petra", "Halvard", "Saskia", "Emrys", "Ottilie", "Ruben",
    "Dagny", "Fennick", "Alma", "Lucan", "Ingrid", "Matthias", "Rosalind", "Sten", "Vera", "Aurel",
    "Brigid", "Konrad", "Elodie", "Hakon", "Minna", "Thaddeus", "Ysolde", "Leopold", "Freya",
    "Gideon", "Clemence", "Nils", "Agathe", "Barnaby", "Solveig", "Ewald", "Henrike", "Piet",
)
_SURNAME_STEMS = (
    "Varn", "Kess", "Tolm", "Brem", "Ostr", "Halv", "Drev", "Marn", "Quill", "Savr", "Therk",
    "Ulm", "Wex", "Yarr", "Zell", "Corv", "Fenw", "Gald", "Isk", "Jorv", "Lind", "Nest", "Pell",
    "Rusk", "Ebb", "Hask",
)
_SURNAME_ENDS = ("holt", "ander", "ling", "berg", "hart", "ley", "rin", "essen", "tonne", "vaal")
_TOWN_STEMS = (
    "Cald", "Brin", "Dunn", "Elmar", "Falk", "Gorr", "Hew", "Ister", "Kelv", "Lorn", "Morv",
    "Narr", "Ostwe", "Penn", "Quarr", "Rosk", "Selb", "Tarn", "Ulv", "Venn", "Wyr", "Ashk",
)
_TOWN_ENDS = ("mere", "moor", "wick", "by", "stead", "holm", "ford", "haven", "dale", "thorpe")
_RIVER_ONSETS = ("V", "Or", "T", "Il", "Sk", "M", "Oud", "Br", "K", "R", "S", "Eb", "L", "Dr",
                 "Gl", "Z")
_RIVER_RIMES = ("elna", "sk", "amber", "va", "arra", "enne", "ra", "isa", "elvo", "anta", "ulme",
                "orra", "ithe", "undra", "aska", "ora")
_BRANDS = ("Brindle", "Copperline", "Northgate", "Hollowell", "Starling", "Quayside", "Greyfen",
           "Amberley", "Tidewell", "Larkspur", "Mossgrove", "Harrowgate")
_COMPANY_KINDS = ("Works", "Instruments", "Foundry", "Mills", "Optics", "Trading Company",
                  "Ropeworks", "Glassworks")
_MATERIALS = ("brass", "glass", "copper", "cork", "tin", "paper", "whalebone", "cedar", "iron",
              "silk", "bamboo", "pewter")
_DEVICES = ("barometer", "loom", "lantern", "sextant", "water pump", "seed drill", "bellows",
            "compass", "kiln", "sundial", "diving bell", "music box", "hearing trumpet",
            "typewriter", "metronome", "bread oven")
_PRODUCTS = (("glass buoys", "glass buoy"), ("copper kettles", "copper kettle"),
             ("weather vanes", "weather vane"), ("wool blankets", "wool blanket"),
             ("fishing nets", "fishing net"), ("pocket watches", "pocket watch"),
             ("rope ladders", "rope ladder"), ("oil lamps", "oil lamp"),
             ("roof tiles", "roof tile"), ("bicycle bells", "bicycle bell"),
             ("ink pens", "ink pen"), ("wooden toys", "wooden toy"),
             ("sailcloth", "sail cloth"), ("church organs", "church organ"),
             ("tin whistles", "tin whistle"), ("garden shears", "garden shear"))
_PROFESSIONS = ("clockmaker", "cartographer", "glassblower", "schoolteacher", "ship's carpenter",
                "bookbinder", "surveyor", "apothecary", "blacksmith", "weaver", "printer",
                "engineer", "miller", "organ builder")
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")

# Sentence variants per fact; `{x}` fields filled per entity. Colour sentences add length and
# variety but state nothing a question asks about.
_PERSON_BIRTH = (
    "{name} was born in {year} in the town of {town}.",
    "Born in {town} in {year}, {name} grew up as the child of a {parent}.",
    "{name} was born in {town} in the year {year}.",
    "{name}, the child of a {parent}, was born in {year} in {town}.",
)
_PERSON_WORK = (
    "{first} trained as a {job} and is best remembered for inventing the {invention}.",
    "Working as a {job}, {first} invented the {invention}.",
    "{first} earned a living as a {job}, but is known today as the inventor of the {invention}.",
    "The {invention} was invented by {first}, who worked as a {job} for most of {pos} life.",
)
_PERSON_COLOUR = (
    "Friends remembered {first} as quiet, stubborn and generous.",
    "{first} kept detailed notebooks, most of which were later lost in a flood.",
    "In later life {first} taught evening classes to apprentices.",
    "{first} spent most evenings reading about distant countries.",
    "Neighbours said {first} could repair almost anything with a knife and some wire.",
    "A small portrait of {first} still hangs in the reading room of the local library.",
    "{first} disliked travel and rarely went further than the next valley.",
    "Early attempts failed, and {first} nearly gave up after a workshop fire.",
    "{first} wrote long letters to a cousin abroad, describing every small improvement.",
)
_TOWN_RIVER = (
    "{town} is a small town on the river {river}.",
    "The town of {town} lies on the river {river}.",
    "{town} grew up around a ford on the river {river}.",
    "{town} stretches along both banks of the river {river}.",
)
_TOWN_FOUNDED = (
    "It was founded in {year} by {founders}.",
    "{founders_cap} founded the town in {year}.",
    "The town was founded in {year}, when {founders} settled there.",
)
_TOWN_PEOPLE = (
    "Today about {pop} people live in {town}.",
    "{town} has a population of about {pop}.",
    "Some {pop} people live there today.",
)
_TOWN_COLOUR = (
    "The old stone bridge in the centre has {arches} arches.",
    "A market is held in the main square every {weekday}.",
    "Every autumn the town holds a lantern festival that draws visitors from the whole valley.",
    "Most of the houses are built from grey slate quarried in the hills nearby.",
    "The winters are long, and the river often freezes in January.",
    "A narrow-gauge railway once linked the town to the coast, but it closed long ago.",
    "The town hall has a clock tower that is said to run five minutes slow.",
    "Local bakers are proud of a dark rye bread flavoured with caraway.",
)
_COMPANY_ORIGIN = (
    "{company} was founded in {year} by {founder}.",
    "{founder} started {company} in {year}.",
    "In {year}, {founder} founded {company}.",
)
_COMPANY_TRADE = (
    "The company is based in {town} and makes {product}.",
    "From its workshops in {town}, the company makes {product}.",
    "{company} makes {product} and is based in {town}.",
)
_COMPANY_COLOUR = (
    "It employs about {staff} people.",
    "Its first workshop was a rented barn with a leaking roof.",
    "The company still uses a hand-painted sign above its main gate.",
    "Most of its apprentices come from the surrounding villages.",
    "Its products are sold mainly to shops along the coast.",
    "A fire in its early years destroyed most of the company's records.",
)
_PARENTS = ("miller", "fisherman", "baker", "carpenter", "farmer", "boatman", "innkeeper",
            "tailor")
_FOUNDERS = ("salt traders", "a group of monks", "fishing families", "wool merchants",
             "miners from the north", "a band of ferrymen")


def build_suite(num_per_task: int = 80, seed: int = 0) -> list[EvalItem]:
    """`num_per_task` items for each task in TASKS, in TASKS order; same seed, same suite."""
    if num_per_task < 0:
        raise ValueError("num_per_task must be at least 0")
    pool = _build_pool(random.Random(f"ragkv-eval:{seed}:pool"))
    items: list[EvalItem] = []
    for task in TASKS:
        rng = random.Random(f"ragkv-eval:{seed}:{task}")
        candidates = _candidates(pool, task)
        order: list[_Fact] = []
        for k in range(num_per_task):
            if k % len(candidates) == 0:  # every fact once before any twice
                order = list(candidates)
                rng.shuffle(order)
            fact = order[k % len(candidates)]
            docs, evidence = _place(pool, task, fact, rng)
            items.append(EvalItem(
                id=f"{task}-{k:04d}", task=task, system=SYSTEM,
                documents=tuple(pool.documents[d] for d in docs), question=fact.question + ASK,
                answer=fact.answer, aliases=fact.aliases, evidence=evidence, bridge=fact.bridge,
            ))
    return items


def normalize_answer(text: str) -> str:
    """SQuAD-style: lowercase, punctuation removed, articles dropped, whitespace collapsed."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def is_correct(prediction: str, item: EvalItem) -> bool:
    """Whether the normalized gold answer (or an alias) occurs in the normalized prediction as
    whole words (so "Velna" does not match "Velnaby")."""
    pred = f" {normalize_answer(prediction)} "
    golds = (normalize_answer(g) for g in (item.answer, *item.aliases))
    return any(f" {g} " in pred for g in golds if g)


def _candidates(pool: _Pool, task: str) -> list[_Fact]:
    if task == "two-hop":
        return list(pool.chains)
    if task == "distractor":
        sizes: dict[int, int] = {}
        for c in pool.cluster:
            sizes[c] = sizes.get(c, 0) + 1
        return [f for f in pool.facts if sizes[pool.cluster[f.docs[0]]] > 1]
    if task in TASKS:
        return list(pool.facts)
    raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")


def _place(pool: _Pool, task: str, fact: _Fact,
           rng: random.Random) -> tuple[list[int], tuple[int, ...]]:
    """Pick the item's documents (pool indices) and where the evidence goes."""
    num_docs = rng.randint(MIN_DOCUMENTS,
                           MAX_TWO_HOP_DOCUMENTS if task == "two-hop" else MAX_DOCUMENTS)
    clusters = {pool.cluster[d] for d in fact.docs}
    similar = [d for d in range(len(pool.documents))
               if pool.cluster[d] in clusters and d not in fact.docs]
    # Similar-named entities appear only where they are the point (the distractor task).
    extra = similar if task == "distractor" else []
    others = [d for d in range(len(pool.documents)) if pool.cluster[d] not in clusters]
    fillers = rng.sample(others, num_docs - len(fact.docs) - len(extra))
    if task.startswith("single-"):
        rest = fillers
        rng.shuffle(rest)
        at = {"single-first": 0, "single-middle": num_docs // 2,
              "single-last": num_docs - 1}[task]
        docs = rest[:at] + [fact.docs[0]] + rest[at:]
    else:
        docs = [*fact.docs, *extra, *fillers]
        rng.shuffle(docs)
    return docs, tuple(docs.index(d) for d in fact.docs)


def _build_pool(rng: random.Random) -> _Pool:
    documents: list[str] = []
    cluster: list[int] = []
    facts: list[_Fact] = []
    chains: list[_Fact] = []

    def add(text: str, cluster_id: int) -> int:
        assert "##" not in text
        documents.append(text)
        cluster.append(cluster_id)
        return len(documents) - 1

    def sentence(templates: tuple[str, ...], **fields: str) -> str:
        return rng.choice(templates).format(**fields)

    def colour(templates: tuple[str, ...], k: int, **fields: str) -> list[str]:
        return [t.format(**fields) for t in rng.sample(templates, k)]

    rivers = [o + r for o in _RIVER_ONSETS for r in _RIVER_RIMES]
    rng.shuffle(rivers)
    products = list(_PRODUCTS)
    rng.shuffle(products)
    inventions = [f"{m} {d}" for m in _MATERIALS for d in _DEVICES]
    rng.shuffle(inventions)
    first_names = list(_FIRST_NAMES)
    rng.shuffle(first_names)

    # Towns: clusters share a stem (Caldmere, Caldmoor), founding years a few decades apart.
    towns: list[tuple[str, int]] = []  # (name, document)
    town_river: dict[str, str] = {}
    town_year: dict[str, str] = {}
    for cid, stem in enumerate(rng.sample(_TOWN_STEMS, 12)):
        base_year = rng.randint(1150, 1750)
        years = rng.sample(range(base_year, base_year + 40), 3)
        for end, year in zip(rng.sample(_TOWN_ENDS, rng.randint(1, 3)), years, strict=False):
            town, river = stem + end, rivers.pop()
            pop = f"{rng.randint(2, 40) * 100 + rng.choice((0, 50)):,}"
            founders = rng.choice(_FOUNDERS)
            text = " ".join([
                sentence(_TOWN_RIVER, town=town, river=river),
                sentence(_TOWN_FOUNDED, year=str(year), founders=founders,
                         founders_cap=founders[0].upper() + founders[1:]),
                sentence(_TOWN_PEOPLE, town=town, pop=pop),
                *colour(_TOWN_COLOUR, rng.randint(1, 3), arches=str(rng.randint(3, 9)),
                        weekday=rng.choice(_WEEKDAYS)),
            ])
            doc = add(text, cid)
            towns.append((town, doc))
            town_river[town], town_year[town] = river, str(year)
            facts += [
                _Fact(f"On which river does {town} lie?", river, (), (doc,)),
                _Fact(f"In what year was {town} founded?", str(year), (), (doc,)),
                _Fact(f"How many people live in {town}?", pop, (), (doc,)),
            ]

    # People: families share a surname, birth years a few years apart.
    people: list[tuple[str, int, str, str]] = []  # (name, document, birth town, birth year)
    for stem, end in rng.sample([(s, e) for s in _SURNAME_STEMS for e in _SURNAME_ENDS], 14):
        cid = len(set(cluster))
        surname, base_year = stem + end, rng.randint(1780, 1920)
        years = rng.sample(range(base_year, base_year + 12), 3)
        for year in years[:rng.randint(1, 3)]:
            first = first_names.pop()
            name, town = f"{first} {surname}", rng.choice(towns)[0]
            invention = inventions.pop()
            text = " ".join([
                sentence(_PERSON_BIRTH, name=name, year=str(year), town=town,
                         parent=rng.choice(_PARENTS)),
                sentence(_PERSON_WORK, first=first, job=rng.choice(_PROFESSIONS),
                         invention=invention, pos="their"),
                *colour(_PERSON_COLOUR, rng.randint(2, 4), first=first),
            ])
            doc = add(text, cid)
            people.append((name, doc, town, str(year)))
            facts += [
                _Fact(f"In which town was {name} born?", town, (), (doc,)),
                _Fact(f"In what year was {name} born?", str(year), (), (doc,)),
                _Fact(f"What did {name} invent?", invention, (), (doc,)),
            ]
            town_doc = next(d for t, d in towns if t == town)
            chains += [
                _Fact(f"On which river lies the town where {name} was born?",
                      town_river[town], (), (doc, town_doc), town),
                _Fact(f"In what year was the town where {name} was born founded?",
                      town_year[town], (), (doc, town_doc), town),
            ]

    # Companies: clusters share a brand word (Brindle Works, Brindle Optics).
    founders = rng.sample(people, min(len(people), 16))
    for brand in rng.sample(_BRANDS, 8):
        cid = len(set(cluster))
        for kind in rng.sample(_COMPANY_KINDS, rng.randint(1, 2)):
            if not founders:
                break
            founder, founder_doc, founder_town, founder_year = founders.pop()
            company, year = f"{brand} {kind}", str(int(founder_year) + rng.randint(22, 50))
            town, town_doc = rng.choice(towns)
            product, product_alias = products.pop() if products else rng.choice(_PRODUCTS)
            text = " ".join([
                sentence(_COMPANY_ORIGIN, company=company, year=year, founder=founder),
                sentence(_COMPANY_TRADE, company=company, town=town, product=product),
                *colour(_COMPANY_COLOUR, rng.randint(2, 4), staff=str(rng.randint(12, 900))),
            ])
            doc = add(text, cid)
            facts += [
                _Fact(f"Who founded {company}?", founder, (), (doc,)),
                _Fact(f"In what year was {company} founded?", year, (), (doc,)),
                _Fact(f"In which town is {company} based?", town, (), (doc,)),
                _Fact(f"What does {company} make?", product, (product_alias,), (doc,)),
            ]
            chains += [
                _Fact(f"In which town was the founder of {company} born?", founder_town, (),
                      (doc, founder_doc), founder),
                _Fact(f"In what year was the founder of {company} born?", founder_year, (),
                      (doc, founder_doc), founder),
                _Fact(f"On which river lies the town where {company} is based?",
                      town_river[town], (), (doc, town_doc), town),
            ]
    # A chain whose answer the first document also states could be answered in one hop.
    chains = [c for c in chains if c.answer not in documents[c.docs[0]]]
    return _Pool(tuple(documents), tuple(cluster), tuple(facts), tuple(chains))
