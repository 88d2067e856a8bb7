"""Selective recompute: which chunk tokens of a sequential-layout request are computed afresh,
attending to everything before them as in an ordinary prefill.

A request reuses its chunks' cached KV re-positioned (the sequential layout), then recomputes a
set R of chunk tokens at every layer: each token of R is a query at its place in the prompt
whose KV list is everything before it (S, earlier chunks, its own chunk so far, with the fresh
K/V of the tokens of R before it), and its fresh K/V go into the request's own slots, replacing
the cached ones in the request's KV list only. The cached entry is never written, so it stays
one copy shared by every request. |R| = 0 is the sequential layout itself; R = every chunk
token is an ordinary full prefill.

R is chosen once per request, after the chunks' KV is ready and before the question is computed:
- `sink` (EPIC's LegoLink): the first tokens of every chunk, where an isolated chunk puts the
  false attention sink its own start became;
- `blend` (CacheBlend): the tokens whose K/V at the check layers deviate most from the cached
  K/V, probing the chunk tokens through the first layers over the cached KV (layer 0's
  attention then is exactly the full prefill's: layer-0 K/V depend on the token alone);
- `query` (ProphetKV, A^3 style): the chunk tokens the question attends to most at the check
  layers, probing the question through the first layers over the cached KV;
- `sink+blend`, `sink+query`: the sink tokens first, the scorer's best for the rest.
Each of a request's n samples chooses (and recomputes) on its own: the choice is the same.

The modules, in the order a request meets them:
- policy.py: a request's `RecomputeSpec` from its own settings and the engine's, and each
  scorer's check layers;
- planner.py: the scheduler's side: the choice without a probe, the probe as a work of the
  step that completes the chunks, the recomputed tokens as works of the steps after;
- probe.py: the probe, a work the model runner executes after the step's forward;
- selection.py: R from the probe's scores, the sink tokens and the budget.
"""
