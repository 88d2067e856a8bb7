"""Where a question's attention goes under full prefill and under the `sequential` layout, layer
by layer, on single-first questions (the fact in the first document): the share of the
question tokens' attention (mean over heads and question tokens) on S, on the first document,
on the later documents and on the question itself, and, at one layer, on each later document's
first 4 tokens, tokens 4-15, the rest but the last 4, and its last 4.

Both layouts are one pass of HF transformers (eager attention, float32) over the same tokens
with an explicit mask, the one-pass references of docs/rag.md: `full` is causal; `sequential`
gives every later document a hidden copy of S right before it (its cached KV was computed
after S and re-positioned), so it sees that copy and itself, and the question sees S and every
document. `--primer` adds the `primed` layout: every later document sees a hidden copy of S and
a fixed primer passage P (benchmarks/diag_primed_chunks.py). Questions come from the
calibration split (suite seed 1009), not the reported one.

    python benchmarks/diag_attention_shift.py --questions 30 [--primer]
"""

from __future__ import annotations

import argparse

import torch

from ragkv import LLM
from ragkv.eval.evaluate import question_prompt
from ragkv.eval.suite import build_suite
from ragkv.model.loader import load_hf_model

REGIONS = ("S", "first document", "later documents", "question")
BUCKETS = ("first 4", "4-15", "middle", "last 4")
# A neutral passage in no eval document's style: the primer P of the `primed` layout.
PRIMER = ("The river rises in the hills to the north and runs south for about two hundred "
          "kilometres before it reaches the sea. Its valley has been farmed for a long time, "
          "and several small towns grew up where roads cross it. The climate is mild, with "
          "most of the rain falling in autumn and winter.")


def layouts(system: list[int], chunks: list[list[int]], question: list[int],
            primer: list[int] | None = None):
    """For `full` and `sequential` (and `primed`, given a primer P): token ids, positions,
    visibility [T, T], and where S, each document and the question sit in those ids (a list of
    (start, end))."""
    s = len(system)
    flat = s + sum(map(len, chunks))
    total = flat + len(question)
    ids = list(system) + [t for c in chunks for t in c] + list(question)
    visible = torch.ones(total, total, dtype=torch.bool).tril()
    spans, start = [], s
    for c in chunks:
        spans.append((start, start + len(c)))
        start += len(c)
    out = {"full": (ids, list(range(total)), visible, spans, (flat, total))}
    # Sequential: every later document sees a copy of S right before it, not S and not the
    # documents before it; copies come after the question, seen by their document alone.
    # Primed: the copy is S + P, so the document's KV is what S + P + document computes.
    # (A copy's positions go below 0 when it is longer than what precedes its document: RoPE
    # attention depends only on position differences, so that computes the same.)
    contexts = {"sequential": list(system)}
    if primer is not None:
        contexts["primed"] = list(system) + list(primer)
    for name, context in contexts.items():
        c = len(context)
        seq_ids, positions = list(ids), list(range(total))
        size = total + c * (len(chunks) - 1)
        vis = torch.zeros(size, size, dtype=torch.bool)
        vis[:total, :total] = visible
        at = total
        for a, b in spans[1:]:
            seq_ids.extend(context)
            positions.extend(range(a - c, a))
            vis[a:b, :a] = False
            vis[a:b, at:at + c] = True
            vis[at:at + c, at:at + c] = torch.ones(c, c, dtype=torch.bool).tril()
            at += c
        out[name] = (seq_ids, positions, vis, spans, (flat, total))
    return out


def additive(visible: torch.Tensor) -> torch.Tensor:
    """The float mask HF transformers adds to the attention logits: 0 where visible, else -inf."""
    return torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))


@torch.inference_mode()
def attention_shares(hf, ids, positions, visible, spans, question):
    """[layers, 4] the question's attention shares on REGIONS, and [layers, 4] the later
    documents' BUCKETS (summed over documents)."""
    out = hf(input_ids=torch.tensor([ids]), attention_mask=additive(visible)[None, None],
             position_ids=torch.tensor([positions]), output_attentions=True)
    q0, q1 = question
    s = spans[0][0]
    regions, buckets = [], []
    for att in out.attentions:
        a = att[0, :, q0:q1].float().mean(dim=(0, 1))
        later = sum(float(a[x:y].sum()) for x, y in spans[1:])
        regions.append([float(a[:s].sum()), float(a[slice(*spans[0])].sum()), later,
                        float(a[q0:q1].sum())])
        row = [0.0] * 4
        for x, y in spans[1:]:
            for k, (u, v) in enumerate(((x, x + 4), (x + 4, x + 16), (x + 16, y - 4),
                                        (y - 4, y))):
                row[k] += float(a[u:max(u, v)].sum())
        buckets.append(row)
    return torch.tensor(regions), torch.tensor(buckets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--questions", type=int, default=30)
    parser.add_argument("--suite-seed", type=int, default=1009)
    parser.add_argument("--bucket-layer", type=int, default=8)
    parser.add_argument("--primer", action="store_true",
                        help="also the `primed` layout (benchmarks/diag_primed_chunks.py)")
    args = parser.parse_args()
    items = [i for i in build_suite(args.questions, seed=args.suite_seed)
             if i.task == "single-first"][:args.questions]
    engine = LLM(args.model, dtype="float32").engine  # the chat template's S / chunks / Q
    hf = load_hf_model(args.model, attn_implementation="eager")
    primer = (engine.tokenizer.encode("\n\n" + PRIMER, add_special_tokens=False)
              if args.primer else None)
    sums: dict[str, list[torch.Tensor]] = {}
    for item in items:
        p = question_prompt(engine, item.system, item.documents, item.question)
        for name, (ids, pos, vis, spans, question) in layouts(
                list(p.system), [list(c) for c in p.chunks], list(p.question), primer).items():
            regions, buckets = attention_shares(hf, ids, pos, vis, spans, question)
            acc = sums.setdefault(name, [torch.zeros_like(regions), torch.zeros_like(buckets)])
            acc[0] += regions
            acc[1] += buckets
    n = len(items)
    names = list(sums)
    print(f"{args.model}, {n} single-first questions (suite seed {args.suite_seed}): the "
          f"question's attention share, {' -> '.join(names)}\n")
    print("| layer | " + " | ".join(REGIONS) + " |")
    print("| --- |" + " --- |" * len(REGIONS))
    shares = [sums[name][0] / n for name in names]
    for layer in range(shares[0].shape[0]):
        print(f"| {layer} | " + " | ".join(" -> ".join(f"{x[layer, k]:.3f}" for x in shares)
                                           for k in range(len(REGIONS))) + " |")
    layer = args.bucket_layer
    buckets = [sums[name][1][layer] / n for name in names]
    print(f"\nLayer {layer}, the later documents' tokens (summed over the documents):")
    print("| " + " | ".join(BUCKETS) + " |")
    print("|" + " --- |" * len(BUCKETS))
    print("| " + " | ".join(" -> ".join(f"{x[k]:.4f}" for x in buckets)
                            for k in range(len(BUCKETS))) + " |")


if __name__ == "__main__":
    main()
