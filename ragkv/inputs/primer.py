"""The chunk primer: one fixed passage P after which every document but the first of a
sequential prompt has its KV computed (inputs/layout.py: a primed layout).

A document's cached KV is computed after S alone, as if it were the first document of the
prompt; read later in a prompt, such KV draws more of the question's attention than a full
prefill's (docs/fidelity.md). Computed after S + P, it is KV of a document that follows
another one, and it still depends only on (model, S, P, document), so it is cached and reused
like any chunk. The question and the generated tokens never read P.
"""

from __future__ import annotations

# Three neutral paragraphs in no particular document's style, separated like documents: a
# later document computed after them is KV of a document that follows a few others. Measured on
# SmolLM2 (docs/fidelity.md), three such paragraphs (~190 tokens) kept more of full prefill's
# answers than one (~60 tokens) at the same recompute; six traded single-middle questions for
# single-first ones.
DEFAULT_CHUNK_PRIMER = (
    "The river rises in the hills to the north and runs south for about two hundred "
    "kilometres before it reaches the sea. Its valley has been farmed for a long time, "
    "and several small towns grew up where roads cross it. The climate is mild, with "
    "most of the rain falling in autumn and winter.\n\n"
    "The old market square lies at the centre of the largest town. Stalls sell bread, "
    "cheese and vegetables from the surrounding farms on most mornings, and a fair is held "
    "there every summer. The buildings around the square are built of grey stone, and many "
    "of them are several hundred years old.\n\n"
    "A railway line follows the valley from the coast to the hills. It was built to carry "
    "timber and wool, and later passengers. Today a few trains a day stop at the small "
    "stations along the way, and the line is used mostly by walkers and by people "
    "travelling to school or to work.")


def primer_text(value: str | None) -> str | None:
    """The passage of a `chunk_primer` setting (None: none)."""
    if value in (None, "none"):
        return None
    return DEFAULT_CHUNK_PRIMER if value == "default" else value


def primer_tokens(tokenizer, value: str | None) -> tuple[int, ...]:
    """P's token ids: the text after a blank line, as a document follows S in a chat prompt."""
    text = primer_text(value)
    if text is None:
        return ()
    return tuple(tokenizer.encode("\n\n" + text, add_special_tokens=False))
