"""Where stop strings are checked: in the text each new token adds to a sample's output."""

from __future__ import annotations

from .detokenizer import IncrementalDetokenizer


def find_stop_string(detok: IncrementalDetokenizer, token_ids: list[int],
                     stops: list[str]) -> str | None:
    """Bring `detok` up to `token_ids` and look for a stop string in the text the last token
    added (and the few characters before it that a stop string could start in); if one is
    found, cut the text where the earliest begins and return it. vLLM's rule: the stop string
    is not part of the output."""
    added = detok.update(token_ids)
    if not added:
        return None
    text = detok.text
    longest = max(len(s) for s in stops)
    start = max(0, len(text) - added - longest + 1)
    earliest = None
    for stop in stops:
        idx = text.find(stop, start)
        if idx >= 0 and (earliest is None or idx < earliest[0]):
            earliest = (idx, stop)
    if earliest is None:
        return None
    detok.truncate(earliest[0])
    return earliest[1]
