"""Answers with *primed* chunks: each later document's KV computed after S and a fixed primer
passage P instead of after S alone, against full prefill and the `sequential` layout, with and
without `query` recompute, on the eval suite's questions.

Why: under `sequential` every later document's KV is computed as if it were the first document
after S, and the question over-reads it (benchmarks/diag_attention_shift.py). A document
computed after some other passage looks like a document that follows another one. P is one
fixed text (by default a neutral paragraph in no eval document's style), so a primed chunk's
KV still depends only on (model, S, P, chunk tokens) and can be cached and reused in any
request; the question never sees P.

Every layout is one pass of HF transformers (eager attention, float32) over the same tokens
with an explicit mask, the way the exactness tests build their references:
- `full`: causal;
- `sequential`: every later document sees a hidden copy of S right before it and itself;
- `primed`: every later document sees a hidden copy of S + P right before it and itself; the
  first document is exact (it sees S), the question sees S and every document, never P;
- `@R` (e.g. `primed@0.2`): the layout with R of the chunk tokens recomputed, chosen as
  `query` chooses them (the question's attention, summed over layers 4, 8 and 12, on the
  tokens after the first document): a recomputed token sees everything before it.
  NOT the engine's selective recompute: in this one pass a later document's other tokens
  read its recomputed tokens as recomputed (their KV changes with them), where the engine's
  keep the cached KV computed without them. `@R` here overstates what the engine's
  `query@R` keeps (docs/fidelity.md, "Primed chunks in the engine"); without `@R` the layouts
  are the engine's exactly.
Answers are greedy (32 tokens, as `ragkv eval` generates), graded as `ragkv eval` grades them.

    python benchmarks/diag_primed_chunks.py --per-task 16 --modes full,sequential,primed,primed@0.2
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from diag_attention_shift import PRIMER, additive, layouts

from ragkv import LLM
from ragkv.eval.evaluate import question_prompt
from ragkv.eval.suite import TASKS, build_suite, is_correct
from ragkv.model.loader import load_hf_model

CHECK_LAYERS = (4, 8, 12)


@torch.inference_mode()
def answer(hf, eos, ids, pos, vis, question, max_tokens, attention=False):
    """Greedy answer tokens, and (`attention`) the question's attention summed over
    CHECK_LAYERS, [len(ids)], from the prefill pass."""
    qs, qe = question
    out = hf(input_ids=torch.tensor([ids]), attention_mask=additive(vis)[None, None],
             position_ids=torch.tensor([pos]), use_cache=True, output_attentions=attention)
    scores = (sum(out.attentions[k][0, :, qs:qe].float().mean(dim=(0, 1)) for k in CHECK_LAYERS)
              if attention else None)
    past, hidden, n = out.past_key_values, ~vis[qe - 1], len(ids)
    token = int(out.logits[0, qe - 1].argmax())
    tokens = [token]
    for i in range(max_tokens - 1):
        if token in eos:
            break
        mask = torch.zeros(1, 1, 1, n + i + 1)
        mask[0, 0, 0, :n][hidden] = float("-inf")
        out = hf(input_ids=torch.tensor([[token]]), attention_mask=mask,
                 position_ids=torch.tensor([[qe + i]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
    return [t for t in tokens if t not in eos], scores


def recomputed(vis, spans, scores, ratio):
    """The visibility with `ratio` of the chunk tokens (the question's most-read ones after the
    first document) recomputed: each sees everything before it in the prompt."""
    later = torch.tensor([x for a, b in spans[1:] for x in range(a, b)])
    n = min(len(later), round(ratio * (spans[-1][1] - spans[0][0])))
    chosen = later[scores[later].topk(n).indices] if n else later[:0]
    vis = vis.clone()
    for x in chosen.tolist():
        vis[x, :] = False
        vis[x, :x + 1] = True
    return vis


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--per-task", type=int, default=16)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--suite-seed", type=int, default=1009,
                        help="1009: the calibration split; 0: the questions `ragkv eval` reports")
    parser.add_argument("--modes", default="full,sequential,primed,primed@0.2")
    parser.add_argument("--primer", default=PRIMER, help="the primer passage P (text)")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    modes = args.modes.split(",")
    scored = {m.partition("@")[0] for m in modes if "@" in m}  # layouts a selection reads
    items = [i for i in build_suite(args.per_task, seed=args.suite_seed) if i.task in tasks]
    engine = LLM(args.model, dtype="float32").engine  # the chat template's S / chunks / Q
    hf = load_hf_model(args.model, attn_implementation="eager")
    tok = engine.tokenizer
    eos = set(engine.checkpoint.eos_token_ids) | {tok.eos_token_id}
    primer = tok.encode("\n\n" + args.primer, add_special_tokens=False)
    print(f"primer: {len(primer)} tokens")
    right: dict[tuple[str, str], list[bool]] = {}
    start = time.time()
    for k, item in enumerate(items):
        p = question_prompt(engine, item.system, item.documents, item.question)
        parts = (list(p.system), [list(c) for c in p.chunks], list(p.question))
        built = layouts(*parts, primer)
        scores = {}
        # Plain layouts first; a recompute mode's selection reads its layout's prefill pass.
        for mode in sorted(modes, key=lambda m: "@" in m):
            name, _, ratio = mode.partition("@")
            ids, pos, vis, spans, question = built[name]
            if ratio:
                if name not in scores:
                    _, scores[name] = answer(hf, eos, ids, pos, vis, question, 1, True)
                vis = recomputed(vis, spans, scores[name], float(ratio))
            tokens, att = answer(hf, eos, ids, pos, vis, question, args.max_tokens,
                                 attention=not ratio and name in scored)
            if att is not None:
                scores[name] = att
            right.setdefault((item.task, mode), []).append(is_correct(tok.decode(tokens), item))
        print(f"{k + 1}/{len(items)} {item.task} {time.time() - start:.0f}s", flush=True)
    print(f"\n{args.model}, suite seed {args.suite_seed}, {args.per_task} questions per task, "
          f"primer {len(primer)} tokens\n")
    print("| mode | " + " | ".join(tasks) + " | overall | per question vs full |")
    print("| --- |" + " --- |" * (len(tasks) + 2))
    full = [x for t in tasks for x in right[(t, "full")]] if "full" in modes else None
    for mode in modes:
        row = [right[(t, mode)] for t in tasks]
        flat = [x for r in row for x in r]
        n, c = len(flat), sum(flat)
        z = 1.96  # Wilson interval
        mid = (c + z * z / 2) / (n + z * z)
        half = z * math.sqrt(c * (n - c) / n + z * z / 4) / (n + z * z)
        agree = ""
        if full is not None and mode != "full":
            pairs = list(zip(full, flat, strict=True))
            agree = " / ".join(str(sum(1 for f, m in pairs if (f, m) == v)) for v in
                               ((True, True), (True, False), (False, True), (False, False)))
        print(f"| {mode} | " + " | ".join(f"{sum(r)}/{len(r)}" for r in row)
              + f" | {c}/{n} ({100 * c / n:.1f}% [{100 * (mid - half):.0f}-"
                f"{100 * (mid + half):.0f}]) | {agree} |")


if __name__ == "__main__":
    main()
