"""Output processing: what a step's logits become for the requests that own them. Scored prompt
tokens keep their log-probabilities, the sampled rows draw their next token (sampling/), each
token meets the stop rules (stop tokens, stop strings, min_tokens, a complete structured
output, max_tokens), and the requests that finished (or, streaming, changed) get a vLLM-shaped
`RequestOutput`, detokenized incrementally.

It also keeps the requests by their parent id (the prompt's n samples), for outputs, aborts
and failures: a failure while serving one request finishes it and its siblings with
finish_reason "error" and the message in `RequestOutput.error`, never the engine.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import torch

from ..host_ints import int64_tensor, to_device
from ..outputs import CompletionOutput, Logprob, RequestOutput
from ..sampling.penalties import TokenHistory
from ..sampling.sampler import sample
from ..sampling.stop import find_stop_string
from ..structured.json_grammar import GrammarBudgetError
from .request import Request, RequestStatus
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput

logger = logging.getLogger("ragkv")


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer, max_model_len: int,
                 device: torch.device) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.device = device
        self._parents: dict[str, list[Request]] = {}
        # Each token id's text, decoded once: prompt logprobs name (k + 1) tokens per prompt
        # token on the engine thread, and the same ids recur (at most the vocabulary).
        self._token_text: dict[int, str] = {}

    def token_text(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    def add(self, requests: list[Request]) -> None:
        """Keep one prompt's samples (a new parent id)."""
        self._parents[requests[0].parent_id] = requests

    def has(self, request_id: str) -> bool:
        """Whether a request (by its parent id) is queued or running."""
        return request_id in self._parents

    def process(self, sched: SchedulerOutput, logits: torch.Tensor,
                include_unfinished: bool) -> list[RequestOutput]:
        """The step's logits into tokens and outputs: one per parent that finished, or with
        `include_unfinished` that got a token."""
        logits = _keep_scores(sched, logits, self.token_text)
        # One row per sampled work, or 1 + k for a request verifying k drafts: row j is
        # sampled as its output token number (tokens so far) + j would be.
        sampled, steps = [], []
        for w in sched.works:
            if w.sample:
                req = w.request
                done = req.num_output_tokens - req.num_drafts
                sampled.extend([req] * (req.num_drafts + 1))
                steps.extend(range(done, done + req.num_drafts + 1))
        touched: dict[str, None] = {}
        history = None
        if any(r.params.has_penalties for r in sampled):
            keep, history = self._histories(sampled, steps, touched)
            if len(keep) < len(sampled):
                sampled, steps = [sampled[i] for i in keep], [steps[i] for i in keep]
                logits = logits[keep]
        if sampled:
            try:
                result = sample(logits, [r.params for r in sampled],
                                [r.seed for r in sampled], steps, history)
            except Exception as e:  # noqa: BLE001 (the sampled requests fail, not the engine)
                logger.exception("sampling failed")
                for req in sampled:
                    self.fail(req, f"sampling failed: {type(e).__name__}: {e}")
                    touched[req.parent_id] = None
                sampled = []
            now = time.monotonic()
            # A request's rows are consecutive; grouped before any of them is taken (taking
            # one may fail its siblings, which drops their drafts).
            groups: list[tuple[Request, int, int]] = []
            for j, req in enumerate(sampled):
                if groups and groups[-1][0] is req:
                    groups[-1] = (req, groups[-1][1], groups[-1][2] + 1)
                else:
                    groups.append((req, j, 1))
            for req, first, rows in groups:
                self._take(req, result, first, rows, now)
                touched[req.parent_id] = None
        outputs = []
        for pid in touched:
            children = self._parents.get(pid)
            if children is not None and (include_unfinished
                                         or all(c.status.finished for c in children)):
                outputs.append(self._output(pid))
        return outputs

    def _take(self, req: Request, result, first: int, rows: int, now: float) -> None:
        """Append what rows first .. first + rows - 1 of a step's samples give `req`: its
        next token, or (verifying drafts) the drafts kept and the token after them."""
        if req.status.finished:
            return  # a sibling failed
        try:
            tokens = result.token_ids[first:first + rows]
            if rows > 1:
                tokens = self.scheduler.accept_drafts(req, tokens)
            for i, token in enumerate(tokens):
                self._append_token(req, token, result.token_logprobs[first + i],
                                   result.top_logprobs[first + i], now)
                if req.status.finished:
                    break
        except Exception as e:  # noqa: BLE001 (this request fails, not the step)
            self._fail_with(req, e)

    def fail(self, req: Request, message: str | None, bad_request: bool = False) -> None:
        """Finish `req` and its siblings (the other samples of its prompt) with an error;
        `bad_request`: the request's own input caused it."""
        now = time.monotonic()
        for child in self._parents.get(req.parent_id, [req]):
            if child is req or not child.status.finished:
                child.error = message or "request failed"
                child.bad_request = child.bad_request or bad_request
                if child.metrics.finished_time is None:
                    child.metrics.finished_time = now
                if not child.status.finished:
                    self.scheduler.finish(child, RequestStatus.FINISHED_ERROR)

    def _fail_with(self, req: Request, e: Exception) -> None:
        """`fail` for an exception raised while serving `req`: a grammar over its budget is
        the request's own doing (a client error), anything else the engine's."""
        if isinstance(e, GrammarBudgetError):
            logger.warning("request %s failed: %s", req.request_id, e)
        else:
            logger.exception("request %s failed", req.request_id)
        self.fail(req, f"{type(e).__name__}: {e}", bad_request=isinstance(e, GrammarBudgetError))

    def fail_parents(self, failed: list[Request]) -> list[RequestOutput]:
        """Fail the siblings of `failed` requests too; the outputs of their parents."""
        for req in failed:
            self.fail(req, req.error)
        parents = dict.fromkeys(r.parent_id for r in failed)
        return [self._output(pid) for pid in parents if pid in self._parents]

    def abort(self, request_id: str) -> None:
        for req in self._parents.pop(request_id, []):
            if not req.status.finished:
                req.metrics.finished_time = time.monotonic()
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def abort_all(self) -> None:
        """Abort every queued and running request."""
        for request_id in list(self._parents):
            self.abort(request_id)
        sched = self.scheduler
        for req in list(sched.running) + list(sched.waiting):
            sched.finish(req, RequestStatus.FINISHED_ABORTED)  # not reachable by id

    def _histories(self, sampled: list[Request], steps: list[int], touched: dict[str, None]
                   ) -> tuple[list[int], list[TokenHistory | None]]:
        """The rows to keep and each kept row's TokenHistory (row j at output index
        steps[j]); a request whose history fails (its grammar's mask over budget) fails alone
        and leaves the batch with its rows."""
        keep: list[int] = []
        history: list[TokenHistory | None] = []
        for j, req in enumerate(sampled):
            if req.status.finished:
                continue  # a sibling failed: no history to build, no token to sample
            try:
                history.append(self._history(req, steps[j]) if req.params.has_penalties
                               else None)
            except Exception as e:  # noqa: BLE001 (this request fails, not the step)
                self._fail_with(req, e)
                touched[req.parent_id] = None
                continue
            keep.append(j)
        return keep, history

    def _history(self, req: Request, step: int) -> TokenHistory:
        """What a request's penalties read for its output token number `step`: a row after
        drafts counts the drafts before it as generated (as decoding without drafts would
        have them). Its prompt's distinct ids go to the device once for all of a parent's
        samples (non-blocking: the step's forward is still running)."""
        prompt = None
        if req.params.repetition_penalty != 1.0:
            if req.prompt_ids_on_device is None:
                siblings = self._parents.get(req.parent_id, ())
                shared = next((s.prompt_ids_on_device for s in siblings
                               if s.prompt_ids_on_device is not None), None)
                if shared is None:
                    shared = to_device(int64_tensor(list(set(req.prompt_token_ids))),
                                       self.device)
                req.prompt_ids_on_device = shared
            prompt = req.prompt_ids_on_device
        early = step < req.params.min_tokens
        allowed, also, ban = None, (), early
        first = req.num_tokens - req.num_drafts
        drafts = req.token_ids[first:first + step - (req.num_output_tokens - req.num_drafts)]
        if req.matcher is not None:
            matcher = (req.matcher.at(req.matcher.states_after(drafts)[-1]) if drafts
                       else req.matcher)
            # Stop tokens only where the output may end (and min_tokens allows): added where
            # it may, banned elsewhere (a stop token with text may fit the grammar's mask).
            allowed = matcher.mask()
            ending = matcher.accepting and not early
            also = tuple(req.stop_ids) if ending else ()
            ban = not ending
        counts = req.output_counts or {}
        if drafts and req.output_counts is not None:
            counts = req.output_counts + Counter(drafts)
        return TokenHistory(counts, prompt, tuple(req.stop_ids) if ban else (), allowed, also)

    def _append_token(self, req: Request, token: int, logprob: float | None,
                      top: tuple[list[int], list[float], int] | None, now: float) -> None:
        req.token_ids.append(token)
        if req.output_counts is not None:
            req.output_counts[token] += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if req.max_tokens == 0:  # the prompt only: its logits were the point
            req.token_ids.pop()
            self._finish(req, RequestStatus.FINISHED_LENGTH)
            return
        if req.logprobs is not None:
            entry = {tid: Logprob(lp, rank=r + 1) for r, (tid, lp) in
                     enumerate(zip(top[0], top[1], strict=False))}
            entry.setdefault(token, Logprob(logprob, rank=top[2]))
            for tid, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([tid])
            req.logprobs.append(entry)
            req.cumulative_logprob += logprob
        status = None
        # vLLM's min_tokens: a stop token ends a sample from the min_tokens-th token on (none
        # is sampled before), a stop string only in text after the first min_tokens tokens.
        # Before that the text stays current, so a later search sees only what later tokens
        # add.
        count = req.num_output_tokens
        if token in req.stop_ids and count >= req.params.min_tokens:
            status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = token if token in req.params.stop_token_ids else None
        elif req.params.stop and count <= req.params.min_tokens:
            req.detokenizer.update(req.token_ids)
        elif req.params.stop:
            stop = find_stop_string(req.detokenizer, req.token_ids, req.params.stop)
            if stop is not None:
                req.text = req.detokenizer.text
                req.stop_reason = stop
                status = RequestStatus.FINISHED_STOPPED
        if req.matcher is not None and token not in req.stop_ids:
            req.matcher.advance(token)
            if status is None and req.matcher.terminal:
                status = RequestStatus.FINISHED_STOPPED  # complete: nothing may follow
        if status is None and (req.num_output_tokens >= req.max_tokens
                               or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if not isinstance(req.stop_reason, str):  # a stop string already cut the text
            ids, end = req.token_ids, req.num_tokens
            if (status is RequestStatus.FINISHED_STOPPED and req.num_output_tokens
                    and ids[-1] in req.stop_ids):
                end -= 1  # the stop token's text is not part of the output (vLLM)
            req.text = req.detokenizer.finish(ids, end)
        req.metrics.finished_time = time.monotonic()
        self.scheduler.finish(req, status)

    def _output(self, parent_id: str) -> RequestOutput:
        children = self._parents[parent_id]
        finished = all(c.status.finished for c in children)
        if finished:
            del self._parents[parent_id]
        first = children[0]
        completions = [
            CompletionOutput(
                index=c.index,
                text=c.text if c.status.finished else _partial_text(c),
                token_ids=list(c.output_token_ids),
                cumulative_logprob=c.cumulative_logprob,
                # A copy: the engine keeps appending while a server thread reads it.
                logprobs=None if c.logprobs is None else list(c.logprobs),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in children
        ]
        error = next((c.error for c in children if c.error is not None), None)
        bad_request = any(c.bad_request for c in children)
        metrics = first.metrics
        if finished and len(children) > 1:  # the request ends with its last sample
            metrics = replace(metrics, finished_time=max(c.metrics.finished_time or 0.0
                                                         for c in children),
                              last_token_time=max(c.metrics.last_token_time or 0.0
                                                  for c in children),
                              **{name: sum(getattr(c.metrics, name) for c in children)
                                 for name in ("num_preemptions", "num_spec_steps",
                                              "num_draft_tokens", "num_accepted_tokens")})
        return RequestOutput(
            request_id=parent_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=completions, finished=finished, num_cached_tokens=first.num_cached_tokens,
            metrics=metrics, error=error, bad_request=bad_request,
            score_logprobs=_scores(first), prompt_logprobs=_prompt_logprobs(first),
        )


def _keep_scores(sched: SchedulerOutput, logits: torch.Tensor,
                 token_text: Callable[[int], str]) -> torch.Tensor:
    """Store the log-probabilities of scored prompt tokens and the prompt logprobs they give;
    the rows to sample from."""
    if not any(w.request.num_logit_tokens for w in sched.works):
        return logits  # one row per sampling work
    sample_rows: list[int] = []
    row = 0
    for w in sched.works:
        n = w.end - w.logits_from
        req = w.request
        first = req.num_prompt_tokens - req.num_logit_tokens
        lo, hi = max(w.logits_from, first), min(w.end, req.num_prompt_tokens)
        if req.num_logit_tokens and lo < hi:
            part = logits[row + lo - w.logits_from:row + hi - w.logits_from]
            rows = torch.log_softmax(part.float(), dim=-1)
            if req.num_scored_tokens:
                start = max(req.num_prompt_tokens - req.num_scored_tokens, lo)
                kept = rows[start - lo:].cpu()
                for t in range(start, hi):  # a recomputed token overwrites its row
                    req.scores[t] = kept[t - start]
            if req.num_prompt_logprob_tokens:
                _keep_prompt_logprobs(req, rows, lo, hi, token_text)
        if w.sample:  # the last row, and one before it for each draft
            sample_rows.extend(range(row + n - 1 - req.num_drafts, row + n))
        row += n
    return logits[sample_rows]


def _keep_prompt_logprobs(req: Request, rows: torch.Tensor, lo: int, hi: int,
                          token_text: Callable[[int], str]) -> None:
    """Row t - lo is the distribution of prompt token t + 1: its entry, vLLM's shape (the
    actual token with its rank, and the k most likely), by t + 1."""
    last = min(hi, req.num_prompt_tokens - 1)  # the row after the prompt is the sample's
    if last <= lo:
        return
    rows = rows[:last - lo]
    actual = torch.tensor(req.prompt_token_ids[lo + 1:last + 1], device=rows.device)
    chosen = rows.gather(1, actual[:, None])[:, 0]
    ranks = (rows > chosen[:, None]).sum(dim=1) + 1
    k = req.params.prompt_logprobs
    top = rows.topk(k, dim=1) if k else None
    chosen, ranks = chosen.tolist(), ranks.tolist()
    values, ids = (top.values.tolist(), top.indices.tolist()) if k else ([], [])
    for i in range(last - lo):
        entry = {tid: Logprob(lp, rank=r + 1)
                 for r, (tid, lp) in enumerate(zip(ids[i] if k else (), values[i] if k else (),
                                                   strict=True))}
        token = req.prompt_token_ids[lo + 1 + i]
        entry.setdefault(token, Logprob(chosen[i], rank=ranks[i]))
        for tid, lp in entry.items():
            lp.decoded_token = token_text(tid)
        req.prompt_logprobs[lo + 1 + i] = entry


def _prompt_logprobs(req: Request) -> list[dict[int, Logprob] | None] | None:
    """vLLM's RequestOutput.prompt_logprobs: one entry per prompt token (None for the first,
    and in a RAG prompt for every token up to the question's first), once all are in."""
    if req.params.prompt_logprobs is None:
        return None
    first = req.num_prompt_tokens - req.num_prompt_logprob_tokens + 1
    if len(req.prompt_logprobs) < req.num_prompt_tokens - first:
        return None
    return [req.prompt_logprobs.get(t) if t >= first else None
            for t in range(req.num_prompt_tokens)]


def _scores(req: Request) -> torch.Tensor | None:
    first = req.num_prompt_tokens - req.num_scored_tokens
    if not req.num_scored_tokens or len(req.scores) < req.num_scored_tokens:
        return None
    return torch.stack([req.scores[t] for t in range(first, req.num_prompt_tokens)])


def _partial_text(req: Request) -> str:
    """The stable text of an unfinished request (an incomplete last character is held back),
    brought up to date incrementally."""
    req.detokenizer.update(req.token_ids)
    return req.detokenizer.text
