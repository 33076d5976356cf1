"""The in-process sampling loop: each distinct prompt is prefilled once, its KV cache expanded to its n rows.

`generate(num_return_sequences=n)` prefills a GRPO group's prompt n times — at real VLM shapes (hundreds of
vision tokens per image, n = 8–16) that prefill, vision tower included, is most of a rollout. Here:

The prompt-sharing helpers (distinct prompts, prefill, cache expansion) are the models room's
(`vlrl.models.kv_cache`), shared with the trainer's no-grad shared-prefix pass.

1. **Prefill once.** Rows whose prompts are equal (same token ids, same vision tensors — a group's n samples,
   and the first turn of the n episodes of a multi-turn group) share one prefill: the distinct prompts are
   left-padded into one batch and run through the model's forward (`TextAdapter.forward_inputs`: exactly the
   inputs, M-RoPE positions included, that the trainer's teacher-forced pass uses), keeping only the last
   position's logits.
2. **Expand the cache.** ``Cache.reorder_cache(row → prompt)`` copies each prompt's keys/values — and a
   linear-attention layer's conv/recurrent states — to its rows. A cache that is not a transformers `Cache`,
   or whose layers leave a state unexpanded, is not trusted: the prompts are then prefilled once per row (the
   old cost, same results), logged once per family.
3. **Decode** with the model's forward and the cache, no `generate`: positions continue from each row's last
   prompt position (+1 per token on every axis — after a text token all three M-RoPE axes are equal, so this
   is what the model's ``get_rope_index`` gives the teacher-forced pass), sampling is the request's
   ``logit_bias`` (empty unless a client of `vlrl serve` sends one), temperature, top-k, top-p and the suppressed
   tokens, nothing else; EOS and the request's ``stop_token_ids`` end a row. Finished rows leave the batch (the cache is compacted when a
   quarter of its rows are done).

**Compiled decode** (``rollout.engine.compile``, `CompiledStep`): after the prefill the expanded cache is copied into a
transformers ``StaticCache`` of ``P + max_new_tokens`` positions (rounded up to `STATIC_LENGTH_STEP`), and one decode
step — the model's forward on one token per row — runs under ``torch.compile`` (``mode="reduce-overhead"``, i.e. CUDA
graphs, on GPUs; inductor's default on CPU): every step has the same shapes (rows never leave the batch, the mask
spans the whole static cache, zeros past each row's last token), so it compiles once per batch shape and replays.
Greedy ids and behaviour log-probs equal the eager loop's (tests/rollout/test_decode_compile.py); sampled ids are
equal in distribution (finished rows keep drawing, so the random stream is consumed differently). A model whose
layers are not all full attention (sliding windows, linear attention) or whose parameters are FSDP2 shards decodes
eagerly (logged once).

Behaviour log-probs are ``log_softmax(logits / temperature)`` of the raw logits (before bias, suppression, top-k
and top-p) at the sampled token: the quantity the teacher-forced pass computes. The samples are equal in
distribution to `generate`'s (the same processors in the same order, then one draw per row from the global
generator by inverting the cumulative distribution, `draw`), not draw-for-draw: `generate`'s
``torch.multinomial`` consumes the random stream differently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vlrl.models import kv_cache
from vlrl.models.adapters import TextAdapter
from vlrl.models.traits import model_traits
from vlrl.rollout.types import Request, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Decoded:
    """The sampled tokens of every row.

    Attributes:
        tokens: per row, the generated token ids (ending with EOS when ``finished`` says so).
        logp: per row, (len(tokens),) behaviour log-probs.
        eos: per row, whether it ended with an EOS token.
        stop_string: per row, whether a stop string ended it.
    """

    tokens: list[list[int]]
    logp: list[torch.Tensor]
    eos: list[bool]
    stop_string: list[bool]


@dataclass
class DecodeStats:
    """What the last `sample` call did: prompts prefilled, rows decoded, whether the cache was expanded."""

    rows: int = 0
    prefilled: int = 0  # sequences run through the prefill (distinct prompts, or ``rows`` on the fallback)
    prefill_tokens: int = 0  # padded prompt positions prefilled
    steps: int = 0
    compactions: int = 0  # times finished rows were dropped from the batch and its cache
    expanded: bool = True
    prefill_seconds: float = 0.0  # prompts through the model (vision tower included), cache expansion
    decode_seconds: float = 0.0  # the token-by-token steps

    def add(self, other: DecodeStats) -> None:
        """Accumulate ``other`` (one batch) into these totals."""
        self.rows += other.rows
        self.prefilled += other.prefilled
        self.prefill_tokens += other.prefill_tokens
        self.steps += other.steps
        self.compactions += other.compactions
        self.expanded = self.expanded and other.expanded
        self.prefill_seconds += other.prefill_seconds
        self.decode_seconds += other.decode_seconds


# ----------------------------------------------------------------------------------------------- sampling
def next_tokens(logits: torch.Tensor, sampling: SamplingParams, suppress: torch.Tensor | None) -> torch.Tensor:
    """(rows,) tokens from raw logits (rows, V): suppressed tokens never; greedy at temperature 0, else
    temperature → top-k → top-p → a draw (the order of `generate`'s logits processors)."""
    logits = logits.float()
    if sampling.logit_bias:  # SGLang's sampling_params.logit_bias (vlrl serve honours what a client sends)
        ids = torch.tensor(list(sampling.logit_bias), dtype=torch.long, device=logits.device)
        bias = torch.tensor(list(sampling.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        logits = logits.index_add(-1, ids, bias.expand(logits.shape[0], -1))
    if suppress is not None:
        logits = logits.index_fill(-1, suppress, float("-inf"))
    if sampling.temperature <= 0:
        return logits.argmax(-1)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]  # (rows, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1)  # ascending, as `TopPLogitsWarper`
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[:, -1] = False  # keep at least the most likely token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return draw(logits.softmax(-1))


def draw(probs: torch.Tensor) -> torch.Tensor:
    """(rows,) one draw per row of ``probs`` (rows, V) by inverting the cumulative distribution: one uniform per
    row and a binary search. Equal in distribution to ``torch.multinomial(probs, 1)``, which draws a random number
    per vocabulary entry — ~9× slower at V = 1024 on this CPU, and it grows with V (`benchmarks/generation.py`)."""
    cdf = probs.double().cumsum(-1)  # (rows, V); float64: no drift over a 150k vocabulary
    u = torch.rand(probs.shape[0], 1, dtype=cdf.dtype, device=probs.device) * cdf[:, -1:]  # in [0, total)
    # the first index whose cdf exceeds u: never a zero-probability token (its cdf equals its predecessor's)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def _stopped_by_string(tokenizer, tokens: list[int], stops: Sequence[str], tail: int) -> bool:
    text = tokenizer.decode(tokens[-tail:], skip_special_tokens=False)  # every token is ≥ 1 byte: tail suffices
    return any(text.endswith(s) for s in stops)


# ----------------------------------------------------------------------------------------------- the loop
@torch.no_grad()
def sample(model: torch.nn.Module, adapter: TextAdapter, rows: Sequence[Request], sampling: SamplingParams, *,
           pad_token_id: int, eos_token_ids: Sequence[int], suppress: Sequence[int] = (),
           on_step: Callable[[], torch.Tensor] | None = None, stats: DecodeStats | None = None,
           compiled: CompiledStep | None = None) -> Decoded:
    """One sample per entry of ``rows`` (a request repeated n times is prefilled once).

    ``on_step``: called after every decode step, returns a (rows,) bool tensor — those rows stop there.
    ``compiled``: decode through this compiled step over a static cache (``rollout.engine.compile``; module docstring)."""
    stats = stats if stats is not None else DecodeStats()
    stats.rows, stats.steps, stats.compactions = len(rows), 0, 0
    start = time.perf_counter()
    device = next(model.parameters()).device
    prompts, prompt_of_row = kv_cache.distinct_prompts(rows)
    logits, cache, prompt_mask, last_position, type_keys = kv_cache.prefill(model, adapter, prompts, pad_token_id)
    stats.prefilled, stats.prefill_tokens, stats.expanded = len(prompts), prompt_mask.numel(), True
    index = torch.tensor(prompt_of_row, dtype=torch.long, device=device)
    if len(prompts) != len(rows) and not kv_cache.expand_cache(cache, index, adapter.family):
        logits, cache, prompt_mask, last_position, type_keys = kv_cache.prefill(model, adapter, list(rows), pad_token_id)
        stats.prefilled, stats.prefill_tokens, stats.expanded = len(rows), prompt_mask.numel(), False
    elif len(prompts) != len(rows):
        logits, prompt_mask, last_position = logits[index], prompt_mask[index], last_position[..., index, :]

    static = compiled.start(model, cache, prompt_mask, sampling.max_new_tokens, adapter.family) \
        if compiled is not None else None  # None: this model decodes eagerly
    stats.prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    N, T = len(rows), sampling.max_new_tokens
    suppress_ids = torch.tensor(sorted(set(suppress)), dtype=torch.long, device=device) if suppress else None
    eos = torch.tensor(sorted(set(eos_token_ids) | set(sampling.stop_token_ids)), dtype=torch.long, device=device)
    temperature = sampling.temperature if sampling.temperature > 0 else 1.0
    tail = max((len(s.encode()) for s in sampling.stop), default=0) + 2
    sampled = _Rows.of(rows, T)
    live = torch.arange(N, device=device)  # the rows still in the batch (the cache's rows, in order)
    done = torch.zeros(N, dtype=torch.bool, device=device)  # over all rows
    ranks = _sharded_ranks(model)
    for step in range(T):
        new = next_tokens(logits, sampling, suppress_ids)  # (live,)
        logp = F.log_softmax(logits.float() / temperature, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        sampled.record(live, new, logp, done, eos, sampling.stop, adapter.tokenizer, tail)
        stats.steps = step + 1
        if on_step is not None:
            done |= on_step().to(device)
        if step == T - 1 or _all_ranks_done(bool(done.all()), ranks):
            break
        if static is not None:  # static shapes: every row stays, the mask grows by one position
            logits = static.step(new, last_position + step + 1, type_keys)
            continue
        keep = ~done[live]  # (live,)
        if 0 < int(keep.sum()) <= 3 * len(live) // 4:  # compact: finished rows leave the cache (all done here,
            # other ranks not: the rows stay and step on, their tokens unused — see `_sharded_ranks`)
            cache.reorder_cache(keep.nonzero().flatten())
            live, new, last_position = live[keep], new[keep], last_position[..., keep, :]
            prompt_mask = prompt_mask[keep]
            stats.compactions += 1
        kwargs = {"input_ids": new.unsqueeze(-1),  # (live, 1)
                  "attention_mask": torch.cat([prompt_mask, prompt_mask.new_ones(len(live), step + 1)], dim=-1),
                  "position_ids": last_position + step + 1}
        kwargs.update({k: torch.zeros_like(kwargs["input_ids"], dtype=torch.int32) for k in type_keys})
        logits, cache = kv_cache.forward_last(model, kwargs, cache)
    stats.decode_seconds = time.perf_counter() - start
    return Decoded(tokens=sampled.tokens, logp=[torch.stack(lp) if lp else torch.zeros(0) for lp in sampled.logps],
                   eos=sampled.eos, stop_string=sampled.stop_string)


@dataclass
class _Rows:
    """What `sample` has sampled so far, per row, and each row's budget of new tokens (the sampling's
    ``max_new_tokens``, or less for a request that says so: a generation continued after a weight update)."""

    tokens: list[list[int]]
    logps: list[list[torch.Tensor]]
    eos: list[bool]
    stop_string: list[bool]
    budgets: list[int]
    budgeted: bool  # some row's budget is below the sampling's (checked at every step then)

    @classmethod
    def of(cls, rows: Sequence[Request], max_new_tokens: int) -> _Rows:
        budgets = [max_new_tokens if r.max_new_tokens is None else min(max_new_tokens, r.max_new_tokens) for r in rows]
        N = len(rows)
        return cls([[] for _ in range(N)], [[] for _ in range(N)], [False] * N, [False] * N, budgets,
                   any(b < max_new_tokens for b in budgets))

    def record(self, live: torch.Tensor, new: torch.Tensor, logp: torch.Tensor, done: torch.Tensor, eos: torch.Tensor,
               stop: Sequence[str], tokenizer, tail: int) -> None:
        """One step: the ``live`` rows' ``new`` tokens and their log-probs appended (rows already ``done`` skipped),
        and ``done`` set where a row ends here — EOS or a stop token, a stop string, its own budget (truncated)."""
        new_cpu, logp_cpu, live_cpu = new.tolist(), logp.cpu(), live.tolist()
        for j, row in enumerate(live_cpu):
            if not done[row]:
                self.tokens[row].append(new_cpu[j])
                self.logps[row].append(logp_cpu[j])
        finished = torch.isin(new, eos) & ~done[live]
        for j in finished.nonzero().flatten().tolist():
            self.eos[live_cpu[j]] = True
        done[live] |= finished
        if not (stop or self.budgeted):
            return
        for row in live_cpu:
            if not done[row] and stop and _stopped_by_string(tokenizer, self.tokens[row], stop, tail):
                self.stop_string[row], done[row] = True, True
            elif not done[row] and len(self.tokens[row]) >= self.budgets[row]:
                done[row] = True


def _sharded_ranks(model: torch.nn.Module) -> torch.device | None:
    """The device of the all-reduce that keeps FSDP2 ranks decoding in step, or None when ``model`` is not
    sharded over several ranks. Each forward of an FSDP2 model all-gathers every unit's parameters — a
    collective of all ranks — so a rank whose rows all ended must go on stepping (rows unused) until every rank's
    have: otherwise its next collective (the next batch's prefill, the update's forward) meets another rank's
    decode step and the ranks deadlock or exchange mismatched tensors (gloo: "Received data size doesn't match").
    transformers' ``generate(synced_gpus=True)`` does the same."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    return next(model.parameters()).device if dist.get_backend() == "nccl" else torch.device("cpu")


def _all_ranks_done(local: bool, ranks: torch.device | None) -> bool:
    """Whether every rank's rows have ended (this rank's alone when the model is not sharded)."""
    if ranks is None:
        return local
    import torch.distributed as dist

    pending = torch.tensor([0.0 if local else 1.0], device=ranks)
    dist.all_reduce(pending)
    return float(pending) == 0.0


# ----------------------------------------------------------------------------------------------- compiled step
STATIC_LENGTH_STEP = 64  # static cache lengths are rounded up to a multiple: batches of similar length share a graph
_EAGER: set[str] = set()  # families decoded eagerly under rollout.engine.compile (logged once each)


def _decode_step(model: torch.nn.Module, cache_key: str, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor, extra: dict) -> torch.Tensor:
    """The model's forward on one token per row against ``cache``; the last position's logits (rows, V)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                **{cache_key: cache}, **extra)
    return out.logits[:, -1]


class CompiledStep:
    """``rollout.engine.compile``: one decode step under ``torch.compile`` over a transformers ``StaticCache`` (module
    docstring). Holds the compiled step and the static cache, reused while the batch shape (rows, cache length,
    dtype, device) stays the same — a new shape allocates a new cache and compiles again. ``mode``: torch.compile's
    (default: ``reduce-overhead`` — CUDA graphs — on a GPU, inductor's default elsewhere); ``backend``: its backend
    (the tests also use ``aot_eager``: the same traced graph, no code generation)."""

    def __init__(self, mode: str | None = None, backend: str = "inductor") -> None:
        self.mode, self.backend = mode, backend
        self._fn: Callable | None = None
        self._cache = None
        self._shape: tuple | None = None
        self.compiles = 0  # static caches allocated (each new batch shape compiles the step again)

    def start(self, model: torch.nn.Module, cache, prompt_mask: torch.Tensor, max_new_tokens: int,
              family: str) -> _StaticRun | None:
        """Copy the prefilled (expanded) ``cache`` into the static cache and return the run that decodes against
        it; None when this model cannot decode statically (then the loop runs eagerly, logged once per family)."""
        reason = _static_problem(model, cache)
        if reason is not None:
            if family not in _EAGER:
                _EAGER.add(family)
                log.warning("rollout.engine.compile: %s decodes eagerly (%s)", family, reason)
            return None
        from transformers.cache_utils import StaticCache

        module = getattr(model, "module", model)
        rows, prompt_len = prompt_mask.shape
        length = -(-(prompt_len + max_new_tokens) // STATIC_LENGTH_STEP) * STATIC_LENGTH_STEP
        first = cache.layers[0].keys
        shape = (rows, length, first.dtype, first.device)
        if self._shape != shape:
            self._cache, self._shape = StaticCache(config=module.config, max_cache_len=length), shape
            self.compiles += 1
        else:
            self._cache.reset()
        for source, target in zip(cache.layers, self._cache.layers, strict=True):
            if not target.is_initialized:
                target.lazy_initialization(source.keys, source.values)
            target.keys[:, :, :prompt_len].copy_(source.keys)
            target.values[:, :, :prompt_len].copy_(source.values)
            target.cumulative_length.fill_(prompt_len)
        if self._fn is None:
            mode = self.mode or ("reduce-overhead" if first.device.type == "cuda" else None)
            self._fn = torch.compile(_decode_step, backend=self.backend, mode=mode, dynamic=False)
        mask = prompt_mask.new_zeros(rows, length)
        mask[:, :prompt_len] = prompt_mask
        return _StaticRun(self._fn, model, model_traits(model).cache_key, self._cache, mask, prompt_len)


@dataclass
class _StaticRun:
    """One `sample` call's decoding against the static cache: the mask over all its positions grows by one
    column per step."""

    fn: Callable
    model: torch.nn.Module
    cache_key: str
    cache: object
    mask: torch.Tensor  # (rows, static length)
    position: int  # the cache position the next token is written to

    def step(self, tokens: torch.Tensor, position_ids: torch.Tensor, type_keys: list[str]) -> torch.Tensor:
        """Logits (rows, V) after feeding ``tokens`` (rows,) at ``position_ids``."""
        self.mask[:, self.position] = 1
        self.position += 1
        input_ids = tokens.unsqueeze(-1)  # (rows, 1)
        extra: dict = {k: torch.zeros_like(input_ids, dtype=torch.int32) for k in type_keys}
        if model_traits(self.model).logits_to_keep:
            extra["logits_to_keep"] = 1
        return self.fn(self.model, self.cache_key, self.cache, input_ids, self.mask, position_ids, extra).clone()


def _static_problem(model: torch.nn.Module, cache) -> str | None:
    """Why ``model`` (with its prefilled ``cache``) cannot decode against a static cache; None when it can."""
    from transformers.cache_utils import Cache, DynamicLayer

    if any(hasattr(p, "to_local") for p in model.parameters()):
        return "its parameters are FSDP2 shards, gathered anew at every step"
    if not isinstance(cache, Cache) or not all(type(layer) is DynamicLayer for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])}) or [type(cache).__name__]
        return f"its cache layers are {kinds}, not full attention only"
    return None
