"""What structured outputs cost, measured side by side in one run on a real model.

For each constraint (none, a JSON schema, the same answer with bounds and lengths, JSON mode,
a choice) it generates `--batch` answers
to RAG-style extraction prompts with greedy decoding, twice: the first pass compiles the
grammar's masks as states are reached (cold), the second finds them cached (warm). Prints
milliseconds per generated token and the ratio to the unconstrained run, how many samples
ended by themselves (not at --max-tokens) and how many parse (and, for the schema, have the
required keys), and the masks' own cost: states reached, the
vocabulary trie's build time, and the mean milliseconds of a first (uncached) mask.

    python benchmarks/bench_structured.py                     # SmolLM2-135M, 8 prompts
    python benchmarks/bench_structured.py --model builtin:small --batch 4
"""

from __future__ import annotations

import argparse
import json
import time

from ragkv import LLM, SamplingParams
from ragkv.structured.params import StructuredOutputsParams
from ragkv.structured.vocabulary import TokenVocabulary

SCHEMA = {"type": "object",
          "properties": {"answer": {"type": "string"},
                         "confidence": {"enum": ["low", "medium", "high"]},
                         "sources": {"type": "array", "items": {"type": "integer"},
                                     "maxItems": 3}},
          "required": ["answer", "confidence", "sources"]}
# The same answer as pydantic writes Field(max_length=60), Field(ge=0, le=1) and
# list[Annotated[int, Field(ge=1, le=4)]]: bounded numbers and a counted string, whose states
# hold the text read, so they are reused less than SCHEMA's.
BOUNDS = {"type": "object",
          "properties": {"answer": {"type": "string", "maxLength": 60},
                         "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                         "sources": {"type": "array", "maxItems": 3,
                                     "items": {"type": "integer", "minimum": 1, "maximum": 4}}},
          "required": ["answer", "confidence", "sources"]}
DOCS = ["The Eiffel Tower is in Paris and was finished in 1889.",
        "Mount Fuji is the highest mountain in Japan, at 3,776 metres.",
        "The Danube flows through ten countries, more than any other river.",
        "Penicillin was discovered by Alexander Fleming in 1928."]
QUESTIONS = ["When was the Eiffel Tower finished?", "How high is Mount Fuji?",
             "Which river flows through the most countries?", "Who discovered penicillin?",
             "Where is the Eiffel Tower?", "What is the highest mountain in Japan?",
             "In which year was penicillin discovered?", "How many countries does the Danube "
             "flow through?"]


def prompts(llm: LLM, n: int) -> list[str]:
    tok = llm.get_tokenizer()
    docs = "\n".join(f"[{i + 1}] {d}" for i, d in enumerate(DOCS))
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": "Answer from the documents in JSON with "
                     "the keys answer, confidence and sources (document numbers)."},
                    {"role": "user", "content": f"{docs}\n\n{QUESTIONS[i % len(QUESTIONS)]}"}]
        out.append(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return out


def valid(text: str, constraint: str) -> bool:
    if constraint == "choice":
        return text in ("yes", "no")
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if constraint == "schema":
        return isinstance(value, dict) and set(value) == set(SCHEMA["required"])
    if constraint == "bounds":
        return (isinstance(value, dict) and set(value) == set(BOUNDS["required"])
                and len(value["answer"]) <= 60 and 0 <= value["confidence"] <= 1
                and all(isinstance(v, int) and 1 <= v <= 4 for v in value["sources"]))
    return isinstance(value, (dict, list))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=1024)
    engine = llm.engine
    batch = prompts(llm, args.batch)
    t = time.perf_counter()
    TokenVocabulary(engine.tokenizer, engine.model_config.vocab_size)
    print(f"model {args.model}: vocabulary trie built in {time.perf_counter() - t:.2f} s "
          f"(once per engine, on the first constrained request)")
    constraints = {"none": None, "schema": StructuredOutputsParams(json=SCHEMA),
                   "bounds": StructuredOutputsParams(json=BOUNDS),
                   "json_object": StructuredOutputsParams(json_object=True),
                   "choice": StructuredOutputsParams(choice=["yes", "no"])}
    base = None
    print(f"{'constraint':<12} {'pass':<5} {'tokens':>6} {'ms/token':>9} {'vs none':>8} "
          f"{'stop':>5} {'valid':>6} {'states':>7} {'ms/new mask':>12}")
    for name, so in constraints.items():
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                structured_outputs=so)
        for label in ("cold", "warm"):
            grammar = None if so is None else engine.structured.matcher(so).grammar
            masks_before = 0 if grammar is None else grammar.num_masks
            t = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            ms = 1000 * elapsed / tokens
            if name == "none" and label == "warm":
                base = ms
            ratio = f"{ms / base:.2f}" if base else "-"
            ok = sum(valid(o.outputs[0].text, name) for o in outs) if so else "-"
            stopped = sum(o.outputs[0].finish_reason == "stop" for o in outs)
            states = "-" if grammar is None else grammar.num_masks
            new = 0 if grammar is None else grammar.num_masks - masks_before
            per_mask = f"{grammar.mask_seconds / max(new, 1) * 1000:.2f}" if new else "-"
            if grammar is not None:
                grammar.mask_seconds = 0.0
            print(f"{name:<12} {label:<5} {tokens:>6} {ms:>9.2f} {ratio:>8} {stopped:>5} {ok!s:>6} "
                  f"{states!s:>7} {per_mask:>12}")
        if so is not None:
            print(f"  e.g. {outs[0].outputs[0].text!r}")


if __name__ == "__main__":
    main()
