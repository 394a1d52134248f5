"""The batched sampler: one `[rows, vocab]` logits tensor in, one token per row out.

The parameters it honours are `kvserve.params.SamplingParams`. `Sampler.sample`
turns one `[rows, vocab]` logits tensor into one token per row, each row honouring its own
parameters, in this order:

1. logit_bias (and the row's suppressed token ids, which become -inf);
2. repetition penalty over prompt + output tokens (HF/vLLM: positive logits are divided by the
   penalty, negative ones multiplied), then presence/frequency penalties over output tokens only
   (OpenAI: ``logit -= count * frequency_penalty + (count > 0) * presence_penalty``); then the
   grammar's bitmask for rows under structured output (tokens the grammar forbids become -inf;
   the masks are filled in one batched call and applied by a C kernel). A greedy row without
   log-probabilities first checks its best token: if the grammar allows it, it is the best
   allowed token too, and the row is left unmasked (`Sampler.guesses`);
3. log-probabilities, when asked for, are the log_softmax of these processed logits: before
   temperature and truncation, so they describe the model's distribution as adjusted by the
   request, not the sharpened/truncated one the token is finally drawn from;
4. greedy rows (temperature 0 or top_k 1, and temperatures below 1e-5, whose division would
   overflow) take the argmax, all together in one op, ties going to the lowest token id;
5. random rows: temperature → top_k → top_p (over the top-k survivors, renormalised) → min_p
   (relative to the most likely surviving token) → draw.

Every truncation is a per-row threshold on the logits, so tokens tied at a boundary survive
together and the outcome never depends on how a sort orders equal values. The draw is by inverse
CDF: one uniform number per row, taken from that row's own generator when the request brought a
seed, against the cumulative sum of the surviving probabilities. A seeded request therefore
produces the same tokens whichever other rows share its batch and wherever it sits in it, and its
generator advances by exactly one draw per randomly sampled step.

Speculative verification (`Sampler.verify`) takes the rows of a speculative chunk: row j is the
target's distribution after the first j guesses (its history, penalties and grammar mask as if
they had been accepted). Each row is processed exactly as above, then row j draws its own token
with the same single uniform number the row would use without speculation, and the guess is
accepted when they agree. For a greedy row that is "accept while the guess is the argmax"; for
a random row it is the rejection rule with a point-mass proposal: the guess is accepted with
probability p(guess), and otherwise the token drawn is distributed as p without the guess,
renormalised. The output distribution is the target's, and a seeded request draws exactly the
same numbers (one per token it keeps) as without speculation.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.engine.structured import GrammarState, fill_bitmasks
from kvserve.model.kernels import CpuKernels
from kvserve.params import SamplingParams

# Below this temperature, dividing logits overflows float32; such rows are sampled greedily,
# which is the limit they approach anyway.
_MIN_TEMPERATURE = 1e-5


def _is_greedy(params: SamplingParams) -> bool:
    """Greedy rows: temperature 0 or top_k 1, and temperatures whose division would overflow."""
    return params.greedy or params.temperature < _MIN_TEMPERATURE


_UINT64_MASK = 2**64 - 1

# A row's top-p nucleus is first sought among this many most likely tokens.
_TOP_P_CANDIDATES = 256


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one request's draws, on the device its logits live on.

    Negative seeds are taken modulo 2**64, so every 64-bit seed is accepted.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _UINT64_MASK)
    return generator


@dataclass(slots=True)
class RowState:
    """What the sampler needs to know about one row of the logits.

    `generator` belongs to the request and is advanced by every step that samples it randomly;
    None means the sampler's own generator. `suppressed_token_ids` are never drawn this step (the
    engine may use it to hold back end-of-sequence tokens). `grammar` is the request's
    structured-output state: only tokens it allows are drawn.
    """

    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    suppressed_token_ids: Sequence[int] = ()
    grammar: GrammarState | None = None
    # A row verifying a guess under a grammar: its mask, already filled (`[ceil(vocab / 32)]`
    # int32 on the CPU); its `grammar` then answers `allows` as the grammar would stand after
    # the guesses before it (`kvserve.engine.structured.GrammarAfter`).
    bitmask: torch.Tensor | None = None


@dataclass(slots=True)
class SampleOutput:
    """One sampled token per row, with log-probabilities where the row asked for them.

    `logprobs[i]` is the log-probability of the chosen token (None when the row did not ask);
    `top_logprobs[i]` lists the row's `params.logprobs` most likely (token_id, logprob) pairs,
    most likely first (an empty list for 0, None when the row did not ask).
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


@dataclass(slots=True)
class Verified:
    """One speculative chunk's outcome: the tokens it keeps (its accepted guesses, then the
    token chosen after them), their log-probabilities where asked for, and where its rows
    start in the logits."""

    token_ids: list[int]
    first_row: int
    num_accepted: int
    logprobs: list[float | None] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = dataclasses.field(default_factory=list)


class Sampler:
    """Samples one token per row of a `[rows, vocab]` logits tensor on any device.

    Not thread-safe: one engine loop owns it. `seed` fixes the sampler's own generator, used for
    rows whose request brought no seed; None seeds it from the operating system. `kernels`:
    the CPU kernels for masks and argmax on CPU logits (None: torch ops).
    """

    def __init__(self, seed: int | None = None, kernels: CpuKernels | None = None) -> None:
        self._seed = seed
        self.kernels = kernels if kernels is not None and kernels.families else None
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed & _UINT64_MASK)
            self._generators[device] = generator
        return generator

    @staticmethod
    def guesses(row: RowState) -> bool:
        """Whether a constrained row tries its unconstrained best token before any mask: a
        greedy row without log-probabilities (its answer is the same either way; a sampled
        row's distribution or a reported log-probability would not be)."""
        return _is_greedy(row.params) and row.params.logprobs is None

    def process_logits(
        self,
        logits: torch.Tensor,
        rows: Sequence[RowState],
        bitmask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The logits after logit_bias, suppression, penalties and grammar masks, as float32.

        Log-probabilities are the log_softmax of this; temperature and truncation come after.
        `logits` itself is never modified. `bitmask` holds the masks of the constrained rows
        that do not guess (`guesses`), in row order, when the caller filled them already
        (beside the forward pass); None fills them here. A guessing row whose best token the
        grammar allows is left unmasked.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {len(rows)} rows")
        # A float32 input is returned as is by .float(); copy before the first in-place change.
        processed = logits.float()
        copied = processed is not logits
        device = processed.device

        bias_rows, bias_tokens, bias_values = [], [], []
        for index, row in enumerate(rows):
            for token_id, bias in row.params.logit_bias:
                bias_rows.append(index)
                bias_tokens.append(token_id)
                bias_values.append(float(bias))
            for token_id in row.suppressed_token_ids:
                bias_rows.append(index)
                bias_tokens.append(token_id)
                bias_values.append(-math.inf)
        if bias_rows:
            if not copied:
                processed, copied = processed.clone(), True
            processed.index_put_(
                (
                    torch.tensor(bias_rows, device=device),
                    torch.tensor(bias_tokens, device=device),
                ),
                torch.tensor(bias_values, device=device),
                accumulate=True,
            )

        penalty_indices = [i for i, row in enumerate(rows) if row.params.has_penalties]
        if penalty_indices:
            if not copied:
                processed, copied = processed.clone(), True
            _apply_penalties(processed, rows)

        constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
        premasked = [
            i for i, row in enumerate(rows) if row.bitmask is not None and not self.guesses(row)
        ]
        if constrained:
            guessing = [i for i in constrained if self.guesses(rows[i])]
            masked = [
                i for i in constrained if not self.guesses(rows[i]) and rows[i].bitmask is None
            ]
            if guessing:
                index = torch.tensor(guessing, device=processed.device)
                best = _argmax(processed.index_select(0, index), self.kernels).tolist()
                missed = [
                    i
                    for i, token in zip(guessing, best, strict=True)
                    if not rows[i].grammar.allows(token)
                ]
            else:
                missed = []
            # A verifying row's mask is filled already.
            premasked += [i for i in missed if rows[i].bitmask is not None]
            missed = [i for i in missed if rows[i].bitmask is None]
            if masked or missed:
                if not copied:
                    processed, copied = processed.clone(), True
                vocab_size = processed.shape[1]
                if masked:
                    if bitmask is None:
                        bitmask = fill_bitmasks([rows[i].grammar for i in masked], vocab_size)
                    apply_token_bitmask(processed, bitmask, masked, self.kernels)
                if missed:
                    missed_mask = fill_bitmasks([rows[i].grammar for i in missed], vocab_size)
                    apply_token_bitmask(processed, missed_mask, missed, self.kernels)
        if premasked:
            if not copied:
                processed, copied = processed.clone(), True
            stacked = torch.stack([rows[i].bitmask for i in premasked])
            apply_token_bitmask(processed, stacked, premasked, self.kernels)
        return processed

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[RowState],
        bitmask: torch.Tensor | None = None,
    ) -> SampleOutput:
        """Draw one token per row; see the module docstring for the order of processing.
        `bitmask`: the constrained rows' grammar masks, when already filled."""
        num_rows = len(rows)
        if num_rows == 0:
            return SampleOutput(token_ids=[], logprobs=[], top_logprobs=[])
        processed = self.process_logits(logits, rows, bitmask)
        device = processed.device
        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)

        greedy_indices = []
        random_indices = []
        for index, row in enumerate(rows):
            params = row.params
            if _is_greedy(params):
                greedy_indices.append(index)
            else:
                random_indices.append(index)

        if greedy_indices:
            if len(greedy_indices) == num_rows:
                token_ids = _argmax(processed, self.kernels)
            else:
                index_tensor = torch.tensor(greedy_indices, device=device)
                token_ids[index_tensor] = _argmax(
                    processed.index_select(0, index_tensor), self.kernels
                )
        if random_indices:
            random_rows = [rows[i] for i in random_indices]
            if len(random_indices) == num_rows:
                token_ids = self._sample_random(processed, random_rows)
            else:
                index_tensor = torch.tensor(random_indices, device=device)
                token_ids[index_tensor] = self._sample_random(
                    processed.index_select(0, index_tensor), random_rows
                )

        logprobs: list[float | None] = [None] * num_rows
        top_logprobs: list[list[tuple[int, float]] | None] = [None] * num_rows
        logprob_indices = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if logprob_indices:
            _fill_logprobs(processed, token_ids, rows, logprob_indices, logprobs, top_logprobs)
        return SampleOutput(
            token_ids=token_ids.tolist(), logprobs=logprobs, top_logprobs=top_logprobs
        )

    def verify(
        self, logits: torch.Tensor, rows: Sequence[RowState], drafts: Sequence[Sequence[int]]
    ) -> list[Verified]:
        """Verify speculative chunks' guesses (see the module docstring).

        logits: `[sum(len(d) + 1 for d in drafts), vocab]`, each chunk's rows in order; `rows`:
        one state per logits row, row j of a chunk carrying the history (and grammar mask) after
        its first j guesses; `drafts`: each chunk's guesses. Returns one `Verified` per chunk.
        """
        if logits.dim() != 2 or logits.shape[0] != sum(len(d) + 1 for d in drafts):
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match the drafts")
        processed = self.process_logits(logits, rows)
        device = processed.device
        greedy_indices = [i for i, row in enumerate(rows) if _is_greedy(row.params)]
        random_indices = [i for i, row in enumerate(rows) if not _is_greedy(row.params)]
        best: dict[int, int] = {}
        if greedy_indices:
            picked = _argmax(_select_rows(processed, greedy_indices).contiguous(), self.kernels)
            best = dict(zip(greedy_indices, picked.tolist(), strict=True))
        # cumulative: [random rows, vocab], each random row's surviving weights summed up
        cumulative = None
        where: dict[int, int] = {}
        if random_indices:
            weights = self._weights(
                _select_rows(processed, random_indices), [rows[i] for i in random_indices]
            )
            cumulative = weights.cumsum(dim=-1)
            where = {row: position for position, row in enumerate(random_indices)}
        chosen = torch.zeros(len(rows), dtype=torch.long, device=device)
        results: list[Verified] = []
        used: list[int] = []
        offset = 0
        for guesses in drafts:
            tokens: list[int] = []
            for j in range(len(guesses) + 1):
                index = offset + j
                if index in best:
                    token = best[index]
                else:
                    row_cum = cumulative[where[index] : where[index] + 1]
                    token = self._draw(row_cum, self._uniforms([rows[index]], device))
                tokens.append(token)
                used.append(index)
                if j == len(guesses) or token != guesses[j]:
                    break
            chosen[offset : offset + len(tokens)] = torch.tensor(tokens, device=device)
            results.append(Verified(tokens, offset, len(tokens) - 1))
            offset += len(guesses) + 1
        logprob_indices = [i for i in used if rows[i].params.logprobs is not None]
        logprobs: list[float | None] = [None] * len(rows)
        top_logprobs: list[list[tuple[int, float]] | None] = [None] * len(rows)
        if logprob_indices:
            _fill_logprobs(processed, chosen, rows, logprob_indices, logprobs, top_logprobs)
        for result in results:
            first = result.first_row
            result.logprobs = logprobs[first : first + len(result.token_ids)]
            result.top_logprobs = top_logprobs[first : first + len(result.token_ids)]
        return results

    @staticmethod
    def _draw(cumulative: torch.Tensor, uniforms: torch.Tensor) -> int:
        """The inverse-CDF draw of one row (`cumulative` [1, vocab], `uniforms` [1, 1]), the
        same arithmetic as `_sample_random`'s."""
        totals = cumulative[:, -1:]
        below_totals = torch.nextafter(totals, torch.zeros_like(totals))
        targets = torch.minimum(uniforms * totals, below_totals)
        return int(torch.searchsorted(cumulative, targets, right=True).item())

    def _sample_random(self, logits: torch.Tensor, rows: Sequence[RowState]) -> torch.Tensor:
        """Draw from rows that all sample randomly; `logits` [rows, vocab] is left unchanged."""
        weights = self._weights(logits, rows)
        # Inverse-CDF draw: one uniform number per row from that row's generator.
        cumulative = weights.cumsum(dim=-1)
        totals = cumulative[:, -1:]
        uniforms = self._uniforms(rows, logits.device)
        # Strictly below the total, so the search always lands on a token with weight > 0: a
        # zero-weight token repeats its predecessor's cumulative value and is never the first
        # entry above the target.
        below_totals = torch.nextafter(totals, torch.zeros_like(totals))
        targets = torch.minimum(uniforms * totals, below_totals)
        return torch.searchsorted(cumulative, targets, right=True).squeeze(1)

    def _weights(self, logits: torch.Tensor, rows: Sequence[RowState]) -> torch.Tensor:
        """The probabilities rows that sample randomly draw from, `[rows, vocab]`: temperature,
        then truncation (dropped tokens at 0, not renormalised)."""
        device = logits.device
        num_rows, vocab_size = logits.shape

        temperatures = [row.params.temperature for row in rows]
        if any(t != 1.0 for t in temperatures):
            logits = logits / torch.tensor(temperatures, device=device).unsqueeze(1)
        # probs: [rows, vocab]
        probs = torch.softmax(logits, dim=-1)

        # Every truncation is a per-row threshold on the probabilities: a token survives when
        # its probability is at least the row's threshold (ties at the boundary survive
        # together). Thresholds are found in probability space, which orders tokens as the
        # logits do, so each row needs one softmax however many truncations it asks for.
        # thresholds: [rows, 1]
        thresholds = torch.zeros((num_rows, 1), device=device)
        truncated = False
        top_k = [_effective_top_k(row.params.top_k, vocab_size) for row in rows]
        top_k_indices = [
            i for i, row in enumerate(rows) if top_k[i] is not None and row.params.top_p >= 1.0
        ]
        if top_k_indices:
            ks = [top_k[i] for i in top_k_indices]
            _set_rows(thresholds, top_k_indices, _top_k_thresholds(probs, top_k_indices, ks))
            truncated = True
        top_p_indices = [i for i, row in enumerate(rows) if row.params.top_p < 1.0]
        if top_p_indices:
            ks = [top_k[i] for i in top_p_indices]
            ps = [rows[i].params.top_p for i in top_p_indices]
            _set_rows(thresholds, top_p_indices, _top_p_thresholds(probs, top_p_indices, ks, ps))
            truncated = True
        min_p = [row.params.min_p for row in rows]
        if any(min_p):
            # The most likely token survives every truncation, so min_p is relative to it.
            min_p_thresholds = probs.amax(dim=-1, keepdim=True) * torch.tensor(
                min_p, device=device
            ).unsqueeze(1)
            thresholds = torch.maximum(thresholds, min_p_thresholds)
            truncated = True
        # weights: [rows, vocab], probabilities with dropped tokens at 0 (not renormalised)
        return torch.where(probs >= thresholds, probs, 0.0) if truncated else probs

    def _uniforms(self, rows: Sequence[RowState], device: torch.device) -> torch.Tensor:
        """One uniform number in [0, 1) per row, as `[rows, 1]`."""
        uniforms = torch.empty((len(rows), 1), device=device)
        unseeded_indices = []
        for index, row in enumerate(rows):
            if row.generator is None:
                unseeded_indices.append(index)
            else:
                uniforms[index] = torch.rand(1, generator=row.generator, device=device)
        if unseeded_indices:
            shared = torch.rand(
                (len(unseeded_indices), 1), generator=self._generator(device), device=device
            )
            _set_rows(uniforms, unseeded_indices, shared)
        return uniforms


def apply_token_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: Sequence[int],
    kernels: CpuKernels | None = None,
) -> None:
    """In place: ``logits[rows[i], t] = -inf`` wherever bit t of ``bitmask[i]`` is clear.

    logits: [num_rows, vocab] float32; bitmask: [len(rows), ceil(vocab / 32)] int32 on the CPU.
    On the CPU the C kernel does it (where `kernels` has it); elsewhere plain tensor ops, never
    a compiled graph.
    """
    on_cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
    if on_cpu and logits.stride(1) == 1 and kernels is not None and kernels.has("bitmask"):
        kernels.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
        return
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # allowed: [len(rows), words * 32] -> [len(rows), vocab]
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab_size:
        padding = torch.zeros((allowed.shape[0], vocab_size - allowed.shape[1]), dtype=torch.bool)
        allowed = torch.cat([allowed, padding], dim=1)
    allowed = allowed[:, :vocab_size].to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, -math.inf)


def _argmax(logits: torch.Tensor, kernels: CpuKernels | None = None) -> torch.Tensor:
    """Per-row argmax, ties to the lowest token id. On the CPU, the C kernel (torch's argmax runs
    on one core and takes ~3 ms for 64 rows of a 49k vocabulary, a twentieth of a decode step);
    it passes over NaN, which torch would pick."""
    on_cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
    if on_cpu and logits.is_contiguous() and kernels is not None and kernels.has("quant_ops"):
        return kernels.topk_rows(logits, 1)[:, 0]
    return logits.argmax(dim=-1)


def _effective_top_k(top_k: int, vocab_size: int) -> int | None:
    """The number of tokens top_k keeps, or None when it keeps them all."""
    if top_k <= 0 or top_k >= vocab_size:
        return None
    return top_k


def _flat_token_index(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """Flat indices ``row * vocab + token`` of every listed token; None when there are none."""
    tokens = list(itertools.chain.from_iterable(token_lists))
    if not tokens:
        return None
    lengths = torch.tensor([len(ids) for ids in token_lists])
    row_ids = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    return (row_ids * vocab_size + torch.tensor(tokens, dtype=torch.long)).to(device)


def _apply_penalties(logits: torch.Tensor, rows: Sequence[RowState]) -> None:
    """Repetition (prompt + output), then presence/frequency (output) penalties, in place.

    Only the logits of tokens in a row's history change, so the work grows with the histories,
    not with rows × vocabulary.
    """
    vocab_size = logits.shape[1]
    device = logits.device
    # flat: [rows * vocab], a view, so writes land in `logits`
    flat = logits.view(-1)

    if any(row.params.repetition_penalty != 1.0 for row in rows):
        # Rows without a repetition penalty list no tokens.
        histories = [
            list(itertools.chain(row.prompt_token_ids, row.output_token_ids))
            if row.params.repetition_penalty != 1.0
            else []
            for row in rows
        ]
        indices = _flat_token_index(histories, vocab_size, device)
        if indices is not None:
            indices = indices.unique()
            penalty = torch.tensor([row.params.repetition_penalty for row in rows], device=device)
            penalty = penalty[indices // vocab_size]
            seen = flat[indices]
            flat[indices] = torch.where(seen > 0, seen / penalty, seen * penalty)

    if any(row.params.presence_penalty != 0.0 for row in rows) or any(
        row.params.frequency_penalty != 0.0 for row in rows
    ):
        outputs = [row.output_token_ids for row in rows]
        indices = _flat_token_index(outputs, vocab_size, device)
        if indices is not None:
            indices, counts = indices.unique(return_counts=True)
            row_ids = indices // vocab_size
            frequency = torch.tensor([row.params.frequency_penalty for row in rows], device=device)
            presence = torch.tensor([row.params.presence_penalty for row in rows], device=device)
            flat[indices] -= counts * frequency[row_ids] + presence[row_ids]


def _set_rows(target: torch.Tensor, indices: Sequence[int], values: torch.Tensor) -> None:
    """``target[indices] = values`` without an index tensor when `indices` covers every row."""
    if len(indices) == target.shape[0]:
        target.copy_(values)
    else:
        target.index_copy_(0, torch.tensor(indices, device=target.device), values)


def _select_rows(x: torch.Tensor, indices: Sequence[int]) -> torch.Tensor:
    if len(indices) == x.shape[0]:
        return x
    return x.index_select(0, torch.tensor(indices, device=x.device))


def _top_k_thresholds(
    probs: torch.Tensor, indices: Sequence[int], top_k: Sequence[int]
) -> torch.Tensor:
    """Each selected row's k-th largest probability, as `[len(indices), 1]`."""
    # values: [selected, max_k], sorted descending
    values = _select_rows(probs, indices).topk(max(top_k), dim=-1).values
    ks = torch.tensor(top_k, device=probs.device).unsqueeze(1)
    return values.gather(1, ks - 1)


def _top_p_thresholds(
    probs: torch.Tensor,
    indices: Sequence[int],
    top_k: Sequence[int | None],
    top_p: Sequence[float],
) -> torch.Tensor:
    """The smallest probability inside each selected row's nucleus, as `[len(indices), 1]`.

    The nucleus is the shortest run of most likely tokens (within the row's top_k, renormalised)
    whose probability reaches top_p. It is sought among the row's most likely candidates first;
    only rows whose nucleus reaches past them pay for sorting the whole vocabulary. Which way a
    row goes depends on that row alone.
    """
    subset = _select_rows(probs, indices)
    vocab_size = subset.shape[1]
    width = min(vocab_size, _TOP_P_CANDIDATES)
    limits = [vocab_size if k is None else k for k in top_k]
    # values: [selected, width], sorted descending
    values = subset.topk(width, dim=-1).values
    kept, resolved = _nucleus(values, limits, top_p)
    thresholds = values.gather(1, kept - 1)
    unresolved = [i for i, done in enumerate(resolved.squeeze(1).tolist()) if not done]
    if unresolved:
        ordered = _select_rows(subset, unresolved).sort(dim=-1, descending=True).values
        ordered_kept, _ = _nucleus(
            ordered, [limits[i] for i in unresolved], [top_p[i] for i in unresolved]
        )
        _set_rows(thresholds, unresolved, ordered.gather(1, ordered_kept - 1))
    return thresholds


def _nucleus(
    values: torch.Tensor, limits: Sequence[int], top_p: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of the descending probabilities `values` each row keeps, and whether that is final.

    Rows whose top_k limit fits inside `values` renormalise over that limit; the others use the
    softmax normalisation over the whole vocabulary. Returns `kept` and `resolved`, `[rows, 1]`.
    """
    device = values.device
    width = values.shape[1]
    # positions: [1, width]
    positions = torch.arange(width, device=device).unsqueeze(0)
    limit = torch.tensor(limits, device=device).unsqueeze(1)
    in_limit = positions < limit
    weights = torch.where(in_limit, values, 0.0)
    cumulative = weights.cumsum(dim=-1)
    fits = limit <= width
    mass_before = (cumulative - weights) / torch.where(fits, cumulative[:, -1:], 1.0)
    p = torch.tensor(top_p, device=device).unsqueeze(1)
    # A token is in the nucleus while the tokens before it hold less than top_p; the first one
    # has nothing before it, so at least one token is always kept.
    kept = ((mass_before < p) & in_limit).sum(dim=-1, keepdim=True)
    resolved = fits | (kept < width)
    return kept, resolved


def _fill_logprobs(
    processed: torch.Tensor,
    token_ids: torch.Tensor,
    rows: Sequence[RowState],
    indices: Sequence[int],
    logprobs: list[float | None],
    top_logprobs: list[list[tuple[int, float]] | None],
) -> None:
    """Write the chosen token's logprob and the top alternatives for the rows `indices`."""
    device = processed.device
    index_tensor = torch.tensor(indices, device=device)
    if len(indices) == processed.shape[0]:
        subset, chosen = processed, token_ids
    else:
        subset, chosen = processed.index_select(0, index_tensor), token_ids[index_tensor]
    # log_probs: [rows, vocab]
    log_probs = torch.log_softmax(subset, dim=-1)
    chosen_logprobs = log_probs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    counts = [rows[i].params.logprobs for i in indices]
    max_count = min(max(counts), log_probs.shape[1])
    top_values: list[list[float]] = [[] for _ in indices]
    top_ids: list[list[int]] = [[] for _ in indices]
    if max_count > 0:
        values, ids = log_probs.topk(max_count, dim=-1, sorted=True)
        top_values, top_ids = values.tolist(), ids.tolist()
    for position, row_index in enumerate(indices):
        count = counts[position]
        logprobs[row_index] = chosen_logprobs[position]
        top_logprobs[row_index] = list(
            zip(top_ids[position][:count], top_values[position][:count], strict=True)
        )
