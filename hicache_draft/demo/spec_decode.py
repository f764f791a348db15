"""Greedy speculative decoding of one request with a target and a draft model over paged KV.

Each step: the draft proposes ``k`` tokens one at a time; the target scores the last emitted
token plus the ``k`` proposals in one forward; the longest prefix of proposals equal to the
target's own greedy choices is accepted, followed by the target's next token (the "bonus").
**Accept length** is the mean number of tokens emitted per verification step, bonus included
(SGLang's ``spec_accept_length``): it lies in ``[1, k + 1]``; 1 means every proposal failed.

Prefill runs in page-aligned chunks: the part of the prompt not yet cached up to the last page
boundary before the prompt's last token, then the rest (so the last token always has a chunk).
A restored prefix is always whole pages, so a restored run and a full recompute run the same
chunks (that is what makes bit-identical logits possible).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hicache_draft.demo.models import TinyLM
from hicache_draft.demo.paged import DevicePool, SeqKV, forward


@dataclass
class DecodeStats:
    """What one decode produced."""

    tokens: list[int] = field(default_factory=list)  # generated tokens, the prefill's one first
    steps: int = 0  # verification steps
    emitted: int = 0  # tokens emitted by verification steps (accepted drafts + bonus)

    @property
    def accept_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


class SpecEngine:
    """One request served by a target and a draft, each with its own paged device pool."""

    def __init__(self, target: TinyLM, draft: TinyLM, page_size: int, max_tokens: int, seed: int) -> None:
        if target.spec.vocab != draft.spec.vocab:
            raise ValueError("target and draft must share a vocabulary")
        pages = -(-max_tokens // page_size) + 1
        self.page_size = page_size
        self.target = SeqKV(DevicePool(target, pages, page_size, seed))
        self.draft = SeqKV(DevicePool(draft, pages, page_size, seed + 1))
        self.vocab = target.spec.vocab
        self.tokens: list[int] = []
        self.target_valid = 0  # leading positions whose target KV is right
        self.draft_valid = 0  # same for the draft
        self.next_logits: torch.Tensor | None = None  # target logits after the last prefill

    def _prev(self, tokens: list[int], start: int, count: int) -> list[int]:
        return [tokens[i - 1] if i > 0 else self.vocab for i in range(start, start + count)]

    def _run(self, seq: SeqKV, tokens: list[int], start: int, end: int) -> torch.Tensor:
        return forward(seq, tokens[start:end], self._prev(tokens, start, end - start), start)

    def _prefill_one(self, seq: SeqKV, tokens: list[int], start: int) -> torch.Tensor:
        aligned = (len(tokens) - 1) // self.page_size * self.page_size
        logits = None
        if start < aligned:
            logits = self._run(seq, tokens, start, aligned)
        if max(start, aligned) < len(tokens):
            logits = self._run(seq, tokens, max(start, aligned), len(tokens))
        if logits is None:
            raise ValueError("nothing to prefill: the whole prompt is cached; keep at least one token")
        return logits[-1]

    def compute_prefix(self, prompt: list[int], end: int) -> None:
        """Compute the KV of ``prompt[:end]`` in both models as one chunk (what a prefill of the
        whole prompt does for its page-aligned part); a later :meth:`prefill` continues from ``end``."""
        if end % self.page_size or not 0 < end < len(prompt):
            raise ValueError(f"prefix {end} must be whole pages and shorter than the prompt")
        self._run(self.target, list(prompt), 0, end)
        self._run(self.draft, list(prompt), 0, end)

    def prefill(self, prompt: list[int], cached: int = 0, draft_cached: int | None = None) -> tuple[
        torch.Tensor, torch.Tensor
    ]:
        """Prefill ``prompt`` whose first ``cached`` tokens' KV is already in the device pools.

        ``draft_cached`` (default ``cached``) is where the draft starts; a server that skipped the
        prefix for the target skips it for the draft too, restored or not. Returns the target's
        and the draft's logits at the last prompt position.
        """
        if cached % self.page_size:
            raise ValueError(f"cached prefix {cached} is not a whole number of pages")
        self.tokens = list(prompt)
        t_logits = self._prefill_one(self.target, self.tokens, cached)
        d_logits = self._prefill_one(self.draft, self.tokens, cached if draft_cached is None else draft_cached)
        self.target_valid = self.draft_valid = len(prompt)
        self.next_logits = t_logits
        return t_logits, d_logits

    def decode(self, new_tokens: int, k: int) -> DecodeStats:
        """Generate ``new_tokens`` tokens (greedy) with ``k`` proposals per step."""
        if self.next_logits is None:
            raise RuntimeError("prefill first")
        if k < 1 or new_tokens < 1:
            raise ValueError("new_tokens and k must be >= 1")
        stats = DecodeStats(tokens=[int(self.next_logits.argmax())])
        self.tokens.append(stats.tokens[0])
        while len(stats.tokens) < new_tokens:
            base = len(self.tokens)  # the last token (position base-1) has no KV yet
            work = list(self.tokens)
            start = self.draft_valid
            for _ in range(k):
                logits = self._run(self.draft, work, start, len(work))
                start = len(work)
                work.append(int(logits[-1].argmax()))
            proposals = work[base:]
            verify = self._run(self.target, work, base - 1, base + k).argmax(dim=-1).tolist()
            n = 0
            while n < k and proposals[n] == verify[n]:
                n += 1
            emitted = proposals[:n] + [verify[n]]
            # KV written for positions base-1 .. base-1+n holds accepted tokens; later ones are stale.
            self.target_valid = base + n
            self.draft_valid = min(base + n, base + k - 1)
            self.tokens.extend(emitted)
            stats.tokens.extend(emitted)
            stats.steps += 1
            stats.emitted += len(emitted)
        return stats

    def full_pages(self) -> int:
        """Leading pages whose target and draft KV are both complete."""
        return min(self.target_valid, self.draft_valid) // self.page_size
