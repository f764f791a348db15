"""Tiny attention-only language models whose next token depends on the context (no downloads).

Every model here is a stack of attention layers over a residual stream cut into named subspaces
(no MLPs, no norms). The weights that matter are *set*, not learned, to build an induction
circuit; every weight then gets a seeded random perturbation, and extra heads are purely random.

Residual subspaces (``de`` = token-vector size, ``dp`` = position-vector size):

* ``tok``  the current token's embedding ``E[t]`` (random unit vectors, one per vocabulary id);
* ``pos``  (target only) a sinusoidal position code ``P(i)`` with random frequencies;
* ``prev`` the embedding of the *previous* token;
* ``out``  what the unembedding reads: ``logits = U @ x[out]`` with ``U = E``.

Target (several layers): layer 0, head 0 is a **previous-token head**: its query is ``R P(i)``
where ``R`` rotates each frequency pair back by one step, so ``R P(i) = P(i-1)`` and the score
peaks at key position ``i-1``; its value copies ``E[t_{i-1}]`` into ``prev``. The last layer's
head 0 is an **induction head**: query ``E[t_i]``, key ``prev``, value ``E[t_j]`` written to
``out``: it finds an earlier position ``j`` whose previous token equals the current token and
predicts the token that followed it. Middle layers and other heads are random.

Draft (one layer, EAGLE-like / MTP-like): its input already carries the previous token in
``prev`` (EAGLE feeds the draft a feature of the previous step next to the current token's
embedding; here that feature is the previous token's embedding, so the draft can run ahead
``k`` steps on its own guesses). Its single layer's head 0 is an induction head over its own,
smaller and noisier token vectors. The draft's prompt KV is therefore what it copies from: a
draft without it guesses from nothing and its proposals are rejected.

MHA layers cache per-head K and V. MLA layers cache one latent vector ``c = W_dkv x`` per token
and layer and up-project K and V from it (as DeepSeek's MLA does, without the rope split): the
latent is ``[what the key needs, what the value needs]``.

DSA (DeepSeek Sparse Attention, V3.2's lightning indexer), for specs with ``index_topk > 0``: every
layer also has an **indexer**. It caches one small key per token and layer, ``k_I = W_ik x``,
stored as fp8 (e4m3) with one float32 scale per token (DeepSeek's 128 + 4 bytes, here ``index_dim
+ 4``), and scores each earlier position ``s`` for query ``t`` as ``sum_h w_h relu(q_{t,h} . k_s)``
over a few indexer heads (DeepSeek's weights ``w`` depend on the token; here they are constants).
The layer's attention then reads **only the ``index_topk`` best-scored cached positions**. The
circuit heads get a matching indexer head: the previous-token layer's scores position ``i-1``
highest (the same rotated position code), the induction layer's scores the positions whose
previous token is the current token. So the indexer keys are part of the cache a restart must
bring back: with stale or empty indexer keys the top-k misses the positions that matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hicache_draft.capabilities import Attention


@dataclass(frozen=True)
class ModelSpec:
    """The shape and construction of one demo model."""

    name: str
    attention: Attention
    layers: int
    heads: int
    head_dim: int
    vocab: int
    token_dim: int  # de
    pos_dim: int  # dp; 0: the model has no positions and gets the previous token as input
    noise: float  # std of the random perturbation, relative to 1/sqrt(fan_in)
    seed: int
    score_scale: float = 12.0  # sharpness of the induction head
    prev_scale: float = 1.5  # sharpness of the previous-token head, per frequency
    max_positions: int = 8192
    index_heads: int = 0  # DSA: indexer query heads (0: dense attention, no indexer)
    index_dim: int = 0  # DSA: size of one indexer key
    index_topk: int = 0  # DSA: cached positions each query's attention reads
    index_score_scale: float = 4.0

    def __post_init__(self) -> None:
        if self.layers < 1 or self.heads < 1 or self.vocab < 2:
            raise ValueError(f"model {self.name!r}: layers, heads and vocab must be positive")
        if self.head_dim < max(self.token_dim, self.pos_dim):
            raise ValueError(f"model {self.name!r}: head_dim must be >= token_dim and pos_dim")
        if self.pos_dim % 2:
            raise ValueError(f"model {self.name!r}: pos_dim must be even")
        if self.pos_dim == 0 and self.layers != 1:
            raise ValueError(f"model {self.name!r}: a model without positions (a draft) has one layer")
        index = (self.index_heads, self.index_dim, self.index_topk)
        if any(index) and not all(v > 0 for v in index):
            raise ValueError(f"model {self.name!r}: a sparse model needs index_heads, index_dim and index_topk >= 1")
        if self.sparse:
            if self.attention is not Attention.MLA:
                raise ValueError(f"model {self.name!r}: sparse attention (DSA) is built on MLA")
            if self.index_dim < max(self.token_dim, self.pos_dim):
                raise ValueError(f"model {self.name!r}: index_dim must be >= token_dim and pos_dim")

    @property
    def sparse(self) -> bool:
        """DSA: each layer's attention reads only the top-k positions its indexer picks."""
        return self.index_topk > 0

    def index_row_bytes(self, page_size: int) -> int:
        """Bytes of one page's indexer keys in one layer: fp8 keys, then one float32 scale per token
        (the layout of SGLang's DSA indexer pool, ``index_k_with_scale_buffer``)."""
        return page_size * (self.index_dim + 4)

    @property
    def uses_positions(self) -> bool:
        return self.pos_dim > 0

    @property
    def d_model(self) -> int:
        return 3 * self.token_dim + self.pos_dim

    @property
    def latent_dim(self) -> int:
        """MLA: the cached latent holds what the key reads and what the value reads."""
        key_part = self.pos_dim if self.uses_positions else self.token_dim
        return max(key_part, self.token_dim) + self.token_dim

    # residual subspaces ------------------------------------------------------------------
    @property
    def tok(self) -> slice:
        return slice(0, self.token_dim)

    @property
    def pos(self) -> slice:
        return slice(self.token_dim, self.token_dim + self.pos_dim)

    @property
    def prev(self) -> slice:
        s = self.token_dim + self.pos_dim
        return slice(s, s + self.token_dim)

    @property
    def out(self) -> slice:
        s = 2 * self.token_dim + self.pos_dim
        return slice(s, s + self.token_dim)


@dataclass
class LayerWeights:
    """One attention layer. MHA: ``wq, wk, wv``; MLA: ``wq, w_dkv, w_uk, w_uv``. All map rows."""

    wq: torch.Tensor  # (d_model, H*D)
    wo: torch.Tensor  # (H*D, d_model)
    wk: torch.Tensor | None = None  # MHA (d_model, H*D)
    wv: torch.Tensor | None = None
    w_dkv: torch.Tensor | None = None  # MLA (d_model, d_c)
    w_uk: torch.Tensor | None = None  # MLA (d_c, H*D)
    w_uv: torch.Tensor | None = None
    wiq: torch.Tensor | None = None  # DSA indexer queries (d_model, index_heads*index_dim)
    wik: torch.Tensor | None = None  # DSA indexer key (d_model, index_dim)
    iw: torch.Tensor | None = None  # DSA indexer head weights (1, index_heads)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer keys ``(T, d)`` as stored: fp8 e4m3 bytes ``(T, d)`` uint8 and a float32 scale per token."""
    scale = keys.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    fp8 = (keys / scale[:, None]).to(torch.float8_e4m3fn)
    return fp8.view(torch.uint8), scale


def dequantize_index_keys(fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the indexer computes with: the stored fp8 keys times their scale (float32)."""
    return fp8.view(torch.float8_e4m3fn).to(torch.float32) * scale[..., None]


class TinyLM:
    """A model built from a :class:`ModelSpec`; deterministic for a given seed."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        g = torch.Generator().manual_seed(spec.seed)
        de, dp, dm = spec.token_dim, spec.pos_dim, spec.d_model
        emb = torch.randn(spec.vocab, de, generator=g)
        self.token_vectors = emb / emb.norm(dim=1, keepdim=True)  # (V, de)
        self.embed = torch.zeros(spec.vocab, dm)
        self.embed[:, spec.tok] = self.token_vectors
        self.prev_embed = torch.zeros(spec.vocab + 1, dm)  # last row: "no previous token"
        self.prev_embed[: spec.vocab, spec.prev] = self.token_vectors
        self.unembed = torch.zeros(dm, spec.vocab)
        self.unembed[spec.out] = self.token_vectors.T
        self.freqs = torch.empty(0)
        self.positions = torch.zeros(spec.max_positions, dm)
        if spec.uses_positions:
            self.freqs = math.pi / 4 + torch.rand(dp // 2, generator=g) * (3 * math.pi / 4)
            idx = torch.arange(spec.max_positions, dtype=torch.float32)[:, None] * self.freqs[None, :]
            code = torch.stack([idx.cos(), idx.sin()], dim=-1).reshape(spec.max_positions, dp)
            self.positions[:, spec.pos] = code / math.sqrt(dp // 2)
        self.layers = [self._layer(i, g) for i in range(spec.layers)]
        self._noise(g)
        for name in ("embed", "prev_embed", "unembed", "positions"):
            setattr(self, name, getattr(self, name).to(device))
        for layer in self.layers:
            for key, value in vars(layer).items():
                if value is not None:
                    setattr(layer, key, value.to(device))

    # -- construction ---------------------------------------------------------------------
    def _random(self, rows: int, cols: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * (scale / math.sqrt(rows))

    def _layer(self, index: int, g: torch.Generator) -> LayerWeights:
        s = self.spec
        H, D, dm = s.heads, s.head_dim, s.d_model
        # Random heads and layers: weak, so they perturb rather than drown the circuit.
        q = self._random(dm, H * D, g, 0.3)
        k_or_c = self._random(dm, H * D, g, 0.3)
        v = self._random(dm, H * D, g, 0.3)
        o = self._random(H * D, dm, g, 0.1)
        o[:, s.out] *= 0.5
        if s.uses_positions and index == 0:
            role = "prev_token"
        elif index == s.layers - 1:
            role = "induction"
        else:
            role = "random"
        key_in, val_in = (s.pos, s.tok) if role == "prev_token" else (s.prev, s.tok)
        if role != "random":
            q[:, :D] = 0
            k_or_c[:, :D] = 0
            v[:, :D] = 0
            o[:D] = 0
            if role == "prev_token":
                rot = self._rotation_back()
                q[s.pos, : s.pos_dim] = rot * (s.prev_scale * s.pos_dim / 2)
                k_or_c[s.pos, : s.pos_dim] = torch.eye(s.pos_dim)
                o[: s.token_dim, s.prev] = torch.eye(s.token_dim)
            else:
                q[s.tok, : s.token_dim] = torch.eye(s.token_dim) * s.score_scale
                k_or_c[s.prev, : s.token_dim] = torch.eye(s.token_dim)
                o[: s.token_dim, s.out] = torch.eye(s.token_dim)
            v[s.tok, : s.token_dim] = torch.eye(s.token_dim)
        if s.attention is Attention.MHA:
            return LayerWeights(wq=q, wo=o, wk=k_or_c, wv=v)
        # MLA: the latent is [key input, value input]; K and V are up-projected from it.
        kw = key_in.stop - key_in.start
        dc = s.latent_dim
        down = torch.zeros(dm, dc)
        down[key_in, :kw] = torch.eye(kw)
        down[val_in, dc - s.token_dim :] = torch.eye(s.token_dim)
        down += self._random(dm, dc, g, 0.05)
        up_k = self._random(dc, H * D, g, 0.3)
        up_v = self._random(dc, H * D, g, 0.3)
        # The circuit head reads its key and value straight out of the latent.
        up_k[:, :D] = 0
        up_v[:, :D] = 0
        up_k[:kw, :D] = k_or_c[key_in, :D]
        up_v[dc - s.token_dim :, :D] = v[val_in, :D]
        weights = LayerWeights(wq=q, wo=o, w_dkv=down, w_uk=up_k, w_uv=up_v)
        if s.sparse:
            self._indexer(weights, role, g)
        return weights

    def _indexer(self, w: LayerWeights, role: str, g: torch.Generator) -> None:
        """The layer's DSA indexer: head 0 scores what the layer's circuit head needs, other heads
        (and every head of a random layer) are random."""
        s = self.spec
        HI, dI, dm = s.index_heads, s.index_dim, s.d_model
        wiq = self._random(dm, HI * dI, g, 0.3)
        wik = self._random(dm, dI, g, 0.3)
        if role == "prev_token":  # scores position i-1 highest, as the previous-token head does
            wiq[:, :dI] = 0
            wik[:] = 0
            wiq[s.pos, : s.pos_dim] = self._rotation_back() * s.index_score_scale
            wik[s.pos, : s.pos_dim] = torch.eye(s.pos_dim)
        elif role == "induction":  # scores the positions whose previous token is the current one
            wiq[:, :dI] = 0
            wik[:] = 0
            wiq[s.tok, : s.token_dim] = torch.eye(s.token_dim) * s.index_score_scale
            wik[s.prev, : s.token_dim] = torch.eye(s.token_dim)
        iw = torch.full((1, HI), 0.25)
        iw[0, 0] = 1.0
        w.wiq, w.wik, w.iw = wiq, wik, iw

    def _rotation_back(self) -> torch.Tensor:
        """``R`` with ``P(i) @ R = P(i-1)`` (rows are the pos code, one 2x2 block per frequency)."""
        n = self.freqs.numel()
        rot = torch.zeros(2 * n, 2 * n)
        for i, w in enumerate(self.freqs.tolist()):
            c, s_ = math.cos(w), math.sin(w)
            # [cos a, sin a] -> [cos(a-w), sin(a-w)] = [c cos a + s sin a, -s cos a + c sin a]
            rot[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor([[c, -s_], [s_, c]])
        return rot

    def _noise(self, g: torch.Generator) -> None:
        sigma = self.spec.noise
        if sigma <= 0:
            return
        self.unembed += self._random(*self.unembed.shape, g, sigma)
        for layer in self.layers:
            for name, value in vars(layer).items():
                if value is not None and name != "iw":  # the indexer's head weights stay as set
                    value += self._random(*value.shape, g, sigma)

    # -- forward ----------------------------------------------------------------------------
    def embed_inputs(self, tokens: torch.Tensor, prev_tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The residual stream's input rows: the token, plus its position (target) or the
        previous token (draft); ``prev_tokens`` uses ``vocab`` for "none"."""
        x = self.embed[tokens]
        if self.spec.uses_positions:
            return x + self.positions[positions]
        return x + self.prev_embed[prev_tokens]
