"""The documents and questions of `ragkv demo`.

Every fact is invented, so a correct answer shows the model read the documents. Each question
names the documents that hold its answer; the demo adds others as distractors and varies their
order, so the same document texts recur in many requests (the chunk cache's case).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DemoQuestion:
    """`expected` is what a correct answer contains (compare case-insensitively);
    `documents` are indices into DOCUMENTS that together hold the answer."""

    question: str
    expected: str
    documents: tuple[int, ...]


SYSTEM = "Answer the question using only the documents. Reply with just the answer."

DOCUMENTS: tuple[str, ...] = (
    "The Vellmark Observatory stands on Mount Irsa, above the fishing town of Portaven. The "
    "astronomer Helga Stroud completed the Vellmark Observatory in 1887, paying for the dome "
    "herself by selling her late father's shipyard. Its main telescope, nicknamed Old Lantern, "
    "has a lens 61 centimetres wide. On clear nights in August the observatory opens to "
    "visitors, who queue along the mountain road to look at Saturn.",

    "Portaven is a fishing town on the northern coast of the island of Merrow. About 6,400 "
    "people live there. The town is known for its blue herring boats and for the Lantern Fair, "
    "held every October, when fishermen float paper lanterns out to sea. The harbour master of "
    "Portaven is Olaf Brenning, who has held the job for twenty-two years.",

    "Quillon Tea is a company founded in 1952 by the brothers Amos and Rufus Tarly. It grows "
    "tea on terraced hills near the village of Sennet and sells a smoky black blend called "
    "Ember Leaf. The company's logo is a grey heron standing on one leg. In 2019 Quillon Tea "
    "opened a small museum about tea picking in an old drying barn.",

    "The Karsk Bridge carries the coast road over the river Tamber. It was designed by the "
    "engineer Ines Varga and opened in 1903. The bridge is 412 metres long and rests on eleven "
    "stone piers. For its first fifty years a toll of one copper coin was charged to every cart "
    "that crossed it, and the old toll house is now a cafe.",

    "Tidewheel is a ball game played on sand. Each team has seven players. Tidewheel was "
    "invented in 1931 by Corin Mabb, a schoolteacher who wanted a game for beaches at low tide. "
    "Players may kick the ball or roll it, but never carry it, and a goal counts double if the "
    "ball passes through standing water. The national Tidewheel cup is a silver bucket.",

    "Brannock pie is the traditional dish of Hollin, a town in the Dunmere valley. It is made "
    "with smoked trout, leeks and a crust of oat pastry, and is eaten cold on the first day of "
    "spring. Local bakers say the recipe comes from a miller's wife named Petra Hollis, who "
    "first baked it in 1794 when the valley's wheat harvest failed.",

    "The Saltmarrow was a three-masted merchant ship built in Portaven in 1868. The captain of "
    "the Saltmarrow was Yusuf Delane, who sailed her with wool and tea between Merrow and the "
    "mainland for more than forty years. She sank in a winter storm in 1911; all nineteen "
    "sailors reached the shore in two lifeboats. Her bell was recovered by divers and hangs in "
    "the harbour office.",

    "Mirela Oskan is a marine biologist at the University of Sennet. In 2011, diving off the "
    "coast of Merrow, she discovered a glowing sea slug that she named the ember slug, after "
    "the orange light it gives off when touched. She has since described fourteen new species "
    "and keeps a tank of ember slugs in her office.",
)

QUESTIONS: tuple[DemoQuestion, ...] = (
    DemoQuestion("Who completed the Vellmark Observatory?", "Helga Stroud", (0,)),
    DemoQuestion("Who is the harbour master of Portaven?", "Olaf Brenning", (1,)),
    DemoQuestion("What is the name of Quillon Tea's smoky black blend?", "Ember Leaf", (2,)),
    DemoQuestion("How long is the Karsk Bridge, in metres?", "412", (3,)),
    DemoQuestion("Who invented Tidewheel?", "Corin Mabb", (4,)),
    DemoQuestion("What fish is used in Brannock pie?", "trout", (5,)),
    DemoQuestion("Who was the captain of the Saltmarrow?", "Yusuf Delane", (6,)),
    DemoQuestion("In what year did Mirela Oskan discover the ember slug?", "2011", (7,)),
    DemoQuestion("Who is the harbour master of the town where the Saltmarrow was built?",
                 "Olaf Brenning", (6, 1)),
)
