"""One sampling call in which some rows follow a grammar (exo/inference/grammar.py).

Every row is first drawn in one vectorised call as usual (`engine.sample_batch`). A constrained row whose draw the
grammar allows keeps it; the others, and constrained rows for which that shortcut would change the distribution
(`sampling.draw_then_check`), draw from their masked logits in a second vectorised call. Either way a constrained
row's token is drawn from: its logits with every token the grammar does not allow next set to -inf, divided by its
temperature, then cut by its top-k, top-p and min-p (greedy: the best allowed token)."""
from typing import List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from exo.inference.closing import within_budget
from exo.inference.grammar import CannotConstrain, Constraint, GrammarError, MaskTimes, compute_masks, in_grammar_thread
from exo.inference.penalties import processes, rows_to_sample
from exo.inference.sampling import SamplingParams, allowed, draw_then_check, last_rows, masked, sample_rows, token_logprobs
from exo.inference.tokenizers import eos_ids


async def prepare(requests: Sequence, tokenizer) -> List[Union[None, Constraint, Exception]]:
  """Each request's ready Constraint, compiled on first use: None where it has no grammar, the error
  (CannotConstrain or GrammarError) where it cannot have one. `requests` are exo/orchestration/requests.py's records."""
  out: List[Union[None, Constraint, Exception]] = []
  for request in requests:
    try:
      constraint = start(request, tokenizer)
      if constraint is not None:
        await constraint.prepare(tokenizer)
      out.append(constraint)
    except (CannotConstrain, GrammarError) as e:
      out.append(e)
  return out


def start(request, tokenizer) -> Optional[Constraint]:
  """The request's Constraint (made on first call) with its compilation started; None if it has no grammar."""
  sampling = request.sampled_here()
  if request.params.grammar and sampling.constraint is None:
    if tokenizer is None:
      raise CannotConstrain("it has no tokenizer for the request's model")
    sampling.constraint = Constraint(request.params.grammar, request.params.bounded_numbers is not False)
  if sampling.constraint is not None:
    sampling.constraint.prepare(tokenizer)
  return sampling.constraint


async def masks_of(constraints: Sequence[Optional[Constraint]], times: Optional[MaskTimes] = None) -> List[Optional[np.ndarray]]:
  """The next-token mask of each ready constraint (None for rows without one), computed on the grammar threads."""
  rows = [i for i, c in enumerate(constraints) if c is not None]
  out: List[Optional[np.ndarray]] = [None] * len(constraints)
  if rows:
    masks = await in_grammar_thread(compute_masks, [constraints[i] for i in rows], times)
    for i, mask in zip(rows, masks):
      out[i] = mask
  return out


async def sample(engine, results: Sequence[np.ndarray], params: Sequence[SamplingParams], generators: Sequence[np.random.Generator],
                 constraints: Sequence[Optional[Constraint]], masks: Optional[Sequence[Optional[np.ndarray]]] = None,
                 times: Optional[MaskTimes] = None, budgets: Optional[Sequence[Optional[int]]] = None) -> Tuple[np.ndarray, np.ndarray]:
  """(tokens, the logit rows they were drawn from): constrained rows as the module docstring says. `masks`, when
  given, holds each constrained row's mask computed beforehand (while the step's forward pass ran). `budgets`, when
  given, holds each row's tokens left, this one included: a constrained row near its end is closed within it
  (exo/inference/closing.py)."""
  n = len(results)
  constrained = [i for i, c in enumerate(constraints) if c is not None]
  if not constrained:
    return np.asarray(await engine.sample_batch(list(results), list(params), list(generators))).reshape(-1).astype(np.int64), None
  if masks is None or any(masks[i] is None for i in constrained):
    masks = await masks_of(constraints, times)
  tokens = np.zeros(n, dtype=np.int64)
  first = [i for i in range(n) if constraints[i] is None or draw_then_check(params[i])]
  if first:
    drawn = await engine.sample_batch([results[i] for i in first], [params[i] for i in first], [generators[i] for i in first])
    tokens[first] = np.asarray(drawn).reshape(-1)
  kept = set(first)
  checked = [i for i in constrained if i in kept]
  if checked:
    ok = allowed(np.stack([masks[i] for i in checked]), tokens[checked])
    kept -= {i for i, good in zip(checked, ok) if not good}
  again = [i for i in constrained if i not in kept]
  rows = last_rows(results)
  if again:
    rows[again] = masked(rows[again], np.stack([masks[i] for i in again]))
    if not np.isfinite(rows[again]).any(axis=-1).all():
      raise GrammarError("the grammar allows no token of this model's vocabulary here")
    tokens[again] = sample_rows(rows[again], [params[i] for i in again], [generators[i] for i in again])
  if budgets is not None:
    near = [i for i in constrained if budgets[i] is not None and constraints[i].closing is not None and constraints[i].budget.watching(budgets[i])]
    for i in constrained:
      if i not in near:
        constraints[i].budget.steps += 1
    if near:
      tokens[near] = await in_grammar_thread(_within_budgets, [constraints[i] for i in near], tokens[near], [budgets[i] for i in near])
  return tokens, rows


def _within_budgets(constraints: Sequence[Constraint], tokens: np.ndarray, budgets: Sequence[int]) -> List[int]:
  return [within_budget(c.matcher, c.budget, c.closing, c.lexer, c.lexer_state, int(t), left) for c, t, left in zip(constraints, tokens, budgets)]


def advance(constraints: Sequence[Optional[Constraint]], tokens: Sequence[int]) -> List[Optional[Exception]]:
  """Feed each constrained row its token; a row whose matcher refuses it gets its error (the others go on)."""
  errors: List[Optional[Exception]] = []
  for constraint, token in zip(constraints, tokens):
    try:
      if constraint is not None:
        constraint.advance(int(token))
      errors.append(None)
    except GrammarError as e:
      errors.append(e)
  return errors


def drawn_as_is(params) -> bool:
  """Whether a request's token is drawn straight from its logits: no grammar masks them, no penalty or bias changes
  them, no logprobs are asked of them."""
  return not (params.grammar or params.logprobs is not None or processes(params))


async def sample_requests(engine, requests: Sequence, results: Sequence[np.ndarray], sampler: str, masks: Optional[Sequence[Optional[np.ndarray]]] = None,
                          times: Optional[MaskTimes] = None, budgets: Optional[Sequence[Optional[int]]] = None) -> List[Union[int, Exception]]:
  """Each request's next token (exo/orchestration/requests.py's records: their parameters, random streams and
  grammars), its logprobs set on the record when it asked, its matcher advanced; a request whose grammar `sampler`
  (the node, for the error) cannot follow gets an error in place of its token. `budgets`: each request's tokens
  left, this one included (a constrained answer is closed within them)."""
  if all(drawn_as_is(r.params) for r in requests):  # the usual rows
    drawn = await engine.sample_batch(list(results), [r.params for r in requests], [r.sampled_here().generator for r in requests])
    return [int(t) for t in np.asarray(drawn).reshape(-1)]
  prepared = await prepare(requests, engine.tokenizer)
  out: List[Union[int, Exception]] = [CannotConstrain(f"{sampler} cannot constrain this request's output, so it does not answer it: {c}")
                                      if isinstance(c, Exception) else 0 for c in prepared]
  rows = [i for i, c in enumerate(prepared) if not isinstance(c, Exception)]
  if not rows:
    return out
  params, constraints = [requests[i].params for i in rows], [prepared[i] for i in rows]
  asked = [requests[i] for i in rows]
  processed = rows_to_sample([results[i] for i in rows], asked, end_tokens(engine))
  drawn, logits = await sample(engine, processed, params, [requests[i].sampled_here().generator for i in rows], constraints,
                               masks and [masks[i] for i in rows], times, budgets and [budgets[i] for i in rows])
  tokens = [int(t) for t in drawn]
  if any(p.logprobs is not None for p in params):  # from the logits each was drawn from, for every row that asked, in one pass
    logits = last_rows(processed) if logits is None else logits
    for i, logprobs in zip(rows, token_logprobs(logits, params, tokens)):
      requests[i].sampled_here().logprobs = logprobs
  for request, token in zip(asked, tokens):
    if (counts := request.sampled_here().penalty_counts) is not None:
      counts.add(token)
  for i, token, error in zip(rows, tokens, advance(constraints, tokens)):
    out[i] = token if error is None else error
  return out


def end_tokens(engine) -> Set[int]:
  tokenizer = getattr(engine, "tokenizer", None)
  return eos_ids(tokenizer) if tokenizer is not None else set()
