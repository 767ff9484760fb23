"""Per-position scores straight from final hidden states and LM heads, in tiles: no [N, V] logits, ever.

A language model's next-token logits are z = softcap(scale * (h W^T + b)) / T (`LMHead`: weight, bias, a logit
scale, Gemma's final-logit softcapping, the KL target's temperature). Everything an estimator but top-k reads from
them is a per-position reduction over the vocabulary:

    log pi(y_t)        z_y - log sum_v exp(z_v)
    log pi_ref(y_t)    r_y - log sum_v exp(r_v)            r the reference's logits
    kappa_t            sum_v p_v (log p_v - log q_v)        the exact KL(pi || pi_ref) at position t (rb's)
    H_t                -sum_v p_v log p_v                   the entropy

`head_scores` computes them a tile of rows x vocabulary at a time, with a running maximum over the vocabulary
(one pass, as an online softmax), and its backward recomputes each tile and writes the gradient of the hidden
states and of the head (weight, bias) tile by tile. No more than one tile's working set of [rows, V-chunk]
float32 is alive, whatever the vocabulary: NeMo-RL's exact-KL distillation loss and a fused linear cross-entropy
do the same for one model; here the reference's logits are recomputed from its hidden states beside the
policy's, so the full-vocabulary KL costs what the log-probs cost, plus one head product of the reference.

Gradients (per row; g_l, g_k, g_e the upstream gradients of log pi(y), kappa and H):

    d/dz = g_l (e_y - p) + g_k p ((log p - log q) - kappa) - g_e p ((z - m) - E_p[z - m])

then through the temperature, the softcap (1 - (u / cap)^2) and the scale to the head's input. Every quantity is
kept as an offset from its row's maximum m (log p - log q = (z - m) - (r - m_r) - log s + log s_r): at logits of
tens of nats a log-normaliser rounds by 4e-6 in float32, more than a small KL, while the likely tokens' offsets are
small numbers, as in a log-softmax; log pi(y) reads z_y from the tile the normaliser sums.

Precision: the softmax arithmetic runs in float32 (float64 stays, for the exact tests), and so do the head's matrix
products by default (LMHead.dtype): a bf16 product rounds a logit of magnitude 10 by up to 0.03, more than a small
per-token KL, and the error does not average out of kappa (docs/scale.md, "The head's precision"). With
LMHead.dtype None the products run in autocast's dtype, as the model's own head does. Either way one dtype serves
both models in a call: the policy's and the reference's logits round alike, so pi = pi_ref gives kappa = 0 exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class LMHead:
    """z = softcap(scale * (h @ weight.T + bias)) / temperature; softcap(x) = cap * tanh(x / cap), none if None.
    dtype: what the product h @ weight.T runs in (inputs cast to it, float64 inputs stay float64); None: autocast's
    dtype where autocast is on, else h's, as the model's own head runs (model.head_dtype=autocast)."""

    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None = None  # [V]
    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0
    dtype: torch.dtype | None = torch.float32

    def at(self, temperature: float) -> "LMHead":
        return replace(self, temperature=float(temperature))

    def post(self, a: torch.Tensor) -> torch.Tensor:
        """The logits from the head's raw output a = h W^T + b (any shape): what a model's forward does after its
        output embedding, in a's dtype as the model does it (bf16 for a bf16 model), then the temperature in
        float32 (float64 stays), as the logits path divides them."""
        z = a * self.scale if self.scale != 1 else a
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        z = z if z.dtype == torch.float64 else z.float()
        return z / self.temperature if self.temperature != 1 else z

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., V] the unfused logits (tests and benchmarks), float32 (float64 stays), the product in
        product_dtype(h, self) as head_scores runs it."""
        cd = product_dtype(h, self)
        with torch.autocast(h.device.type, enabled=False):
            b = None if self.bias is None else self.bias.to(cd)
            return self.post(torch.nn.functional.linear(h.to(cd), self.weight.to(cd), b))


@dataclass
class Scores:
    """[N] each, float32 (float64 stays): the per-position quantities of N rows; None where not asked for."""

    logp: torch.Tensor
    ref_logp: torch.Tensor | None = None
    kappa: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def _acc(dtype: torch.dtype) -> torch.dtype:  # the softmax arithmetic's dtype: float64 stays (the exact tests)
    return torch.float64 if dtype == torch.float64 else torch.float32


def tile_shape(rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(rows, vocabulary columns) of one tile: 2^20 float32 elements (4 MiB) on CPU, 128 rows against a [8192, H]
    slice of the head that stays in cache across them; 2^26 (256 MiB) on accelerators, to amortise launches."""
    budget, cols = (2 ** 20, 8192) if device.type == "cpu" else (2 ** 26, 32768)
    cols = min(vocab, cols)
    return max(1, min(rows, budget // cols)), cols


def product_dtype(h: torch.Tensor, head: LMHead) -> torch.dtype:
    """The dtype of the head's matrix products for hidden states h: float64 stays (the exact tests), else the head's
    dtype, else (None) autocast's where it is on, as the model's own head would run, else h's. Read once per call,
    outside any block that turns autocast off, and used for both models' products."""
    kind = h.device.type
    if h.dtype == torch.float64:
        return h.dtype
    if head.dtype is not None:
        return head.dtype
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return h.dtype


def _tile(h: torch.Tensor, head: LMHead, v0: int, v1: int, cd: torch.dtype, acc: torch.dtype) -> torch.Tensor:
    """[r, v1 - v0] logits of one tile, in acc."""
    b = None if head.bias is None else head.bias[v0:v1].to(cd)
    return head.post(torch.nn.functional.linear(h.to(cd), head.weight[v0:v1].to(cd), b)).to(acc)


def _in_tile(tokens: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([r] bool: the row's token is in columns v0..v1-1, [r, 1] its column there, clamped where it is not)."""
    return (tokens >= v0) & (tokens < v1), (tokens - v0).clamp(0, v1 - v0 - 1).unsqueeze(-1)


def _take(z: torch.Tensor, tokens: torch.Tensor, v0: int, v1: int, into: torch.Tensor) -> torch.Tensor:
    """into [r] with z's entry at each row's token where the token is in this tile: the logit of y is read from
    the very tile the normaliser sums (the same rounding in both, as a log-softmax's gather has)."""
    inside, col = _in_tile(tokens, v0, v1)
    return torch.where(inside, z.gather(-1, col).squeeze(-1), into)


def _dz_da(z: torch.Tensor, head: LMHead) -> torch.Tensor | float:
    """dz/da elementwise: scale / T, times 1 - tanh^2 under the softcap (tanh = z T / cap)."""
    k = head.scale / head.temperature
    if not head.softcap:
        return k
    t = z * (head.temperature / head.softcap)
    return (1 - t * t) * k


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [r]: sum a * b by rows, no [r, vb] product written
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(-1)).view(-1)


class _Running:
    """A row block's softmax over vocabulary chunks, kept as its running maximum m and s = sum exp(z - m), and the
    p-weighted sums of (z - m) (the entropy) and of (r - m_r) (kappa), rescaled whenever m grows. Everything is an
    offset from a maximum: at logits of tens of nats a log-normaliser rounds by 4e-6 in float32, more than a small
    KL, while the offsets of the likely tokens are small numbers, as in a log-softmax."""

    def __init__(self, rows: int, acc: torch.dtype, device: torch.device):
        self.m = torch.full((rows,), -torch.inf, dtype=acc, device=device)  # [r]
        self.s, self.sz, self.sr = (torch.zeros_like(self.m) for _ in range(3))  # [r] each

    def add(self, z: torch.Tensor, rs: torch.Tensor | None = None, offsets: bool = False) -> None:
        """z [r, vb] one chunk's logits (overwritten); rs [r, vb] the reference's r - m_r; offsets: sum p (z - m)."""
        m_new = torch.maximum(self.m, z.amax(-1))
        alpha = torch.exp(self.m - m_new)  # [r]: what was summed under the old maximum, rescaled
        zm = z.sub_(m_new.unsqueeze(-1))  # [r, vb] z - m, in place
        e = torch.exp(zm)  # [r, vb]
        if offsets:  # sum e (z - m) moves with m by s (m_old - m_new): zero while nothing is summed yet
            moved = torch.where(self.s > 0, self.s * (self.m - m_new), 0.0)
            self.sz = (self.sz + moved) * alpha + _dot(e, zm)
        if rs is not None:
            self.sr = self.sr * alpha + _dot(e, rs)
        self.s = self.s * alpha + e.sum(-1)
        self.m = m_new


def _reduce(h, head, tokens, cd, acc, ref=None, offsets: bool = True):
    """One pass over h's tiles: (m, log s, z_y, E_p[z - m], E_p[r - m_r]) per row, [N] each.
    ref: (h_ref, ref_head, m_r) for kappa's sum; None: the last is zeros. offsets: E_p[z - m] (else zeros)."""
    dev = h.device
    N, V = h.shape[0], head.weight.shape[0]
    rb, vb = tile_shape(N, V, dev)
    out = [torch.zeros(N, dtype=acc, device=dev) for _ in range(5)]
    for r0 in range(0, N, rb):
        r1 = min(N, r0 + rb)
        run, zy = _Running(r1 - r0, acc, dev), out[2][r0:r1]
        for v0 in range(0, V, vb):
            v1 = min(V, v0 + vb)
            z = _tile(h[r0:r1], head, v0, v1, cd, acc)  # [r, vb]
            zy = _take(z, tokens[r0:r1], v0, v1, zy)  # before add() overwrites z
            rs = None if ref is None else _tile(ref[0][r0:r1], ref[1], v0, v1, cd, acc).sub_(ref[2][r0:r1, None])
            run.add(z, rs, offsets=offsets)
        for x, v in zip(out, (run.m, torch.log(run.s), zy, run.sz / run.s, run.sr / run.s)):
            x[r0:r1] = v
    return out


class _HeadScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, h_ref, ref_weight, ref_bias, tokens, head, ref_head, want_kappa, m_r, ls_r,
                cd):
        ctx.cd = cd
        acc = _acc(h.dtype)
        with torch.autocast(h.device.type, enabled=False):
            m, ls, zy, mz, mr = _reduce(h, head, tokens, cd, acc, (h_ref, ref_head, m_r) if want_kappa else None)
        logp = (zy - m) - ls  # log p(y): differences of small numbers, as a log-softmax's
        gap = mz - mr  # E_p[(z - m) - (r - m_r)]
        kappa = gap - ls + ls_r if want_kappa else torch.zeros_like(logp)  # E_p[log p - log q]
        entropy = ls - mz
        ctx.save_for_backward(h, h_ref, tokens, m, ls, gap, mz, m_r)
        ctx.heads, ctx.want_kappa = (head, ref_head), want_kappa
        ctx.set_materialize_grads(False)
        return logp, kappa, entropy

    @staticmethod
    def backward(ctx, g_l, g_k, g_e):
        h, h_ref, tokens, m, ls, gap, mz, m_r = ctx.saved_tensors
        head, ref_head = ctx.heads
        g_k = g_k if ctx.want_kappa else None
        grads_of = ctx.needs_input_grad[:3]
        g_l, g_k, g_e = (None if g is None or not g.any() else g.to(m.dtype).unsqueeze(-1) for g in (g_l, g_k, g_e))
        if not any(grads_of):
            return (None,) * 13
        if g_l is None and g_k is None and g_e is None:
            # every upstream gradient 0 (loo's advantages at pi = pi_ref, no reward): the gradient is zeros, as the
            # logits path's autograd gives, not None. An optimizer tells them apart: AdamW skips a None, with its
            # weight decay and step count, and a run would train differently on the two paths
            zeros = [torch.zeros_like(x) if need else None for x, need in zip((h, head.weight, head.bias), grads_of)]
            return (*zeros,) + (None,) * 10
        acc, cd = m.dtype, ctx.cd
        N, V = h.shape[0], head.weight.shape[0]
        rb, vb = tile_shape(N, V, h.device)
        # d/dz = p (g_k ((z - m) - (r - m_r) - gap) - g_e ((z - m) - E_p[z - m]) - g_l) + g_l e_y, written as
        # exp(z - m) (k_k (z - r) - k_e z + c): every per-row factor times exp(-log s), so that exp(z - m) is p,
        # and the row's constant c computed in float64 (it holds m and m_r, tens of nats)
        w = torch.exp(-ls).double()  # [N]
        c = torch.zeros_like(w)
        if g_l is not None:
            c -= g_l[:, 0].double()
        if g_k is not None:
            c += g_k[:, 0].double() * (m_r.double() - m.double() - gap.double())
        if g_e is not None:
            c += g_e[:, 0].double() * (m.double() + mz.double())
        c = (c * w).to(acc).unsqueeze(-1)  # [N, 1]
        k_k = None if g_k is None else (g_k[:, 0].double() * w).to(acc).unsqueeze(-1)  # [N, 1]
        k_e = None if g_e is None else (g_e[:, 0].double() * w).to(acc).unsqueeze(-1)  # [N, 1]
        linear_ref = not ref_head.softcap and cd == acc  # r = s_r (h_ref W_r^T + b_r), s_r a number
        s_r = ref_head.scale / ref_head.temperature
        with torch.autocast(h.device.type, enabled=False):
            gh = torch.zeros(h.shape, dtype=acc, device=h.device) if grads_of[0] else None  # [N, H]
            gw = torch.zeros(head.weight.shape, dtype=acc, device=h.device) if grads_of[1] else None  # [V, H]
            gb = torch.zeros(V, dtype=acc, device=h.device) if grads_of[2] else None  # [V]
            for r0 in range(0, N, rb):
                r1 = min(N, r0 + rb)
                x, rows = h[r0:r1], slice(r0, r1)
                for v0 in range(0, V, vb):
                    v1 = min(V, v0 + vb)
                    z = _tile(x, head, v0, v1, cd, acc)  # [r, vb]
                    dz = _dz_da(z, head)  # [r, vb] under a softcap, else a number
                    if g_l is not None:
                        inside, col = _in_tile(tokens[rows], v0, v1)
                        one = g_l[rows] * inside.unsqueeze(-1) * _dz_da(z.gather(-1, col), head)  # [r, 1]
                    # d = k_k (z - r) - k_e z + c. z - r is written by the reference's own product where its
                    # logits are linear in its hidden states (no softcap, one dtype): z + (-s_r h_ref) W_r^T, one
                    # rounding, as a subtraction of the two tiles would give, without a tile of r
                    if g_k is None:
                        d = c[rows] if g_e is None else torch.addcmul(c[rows], z, k_e[rows], value=-1)
                    else:
                        if linear_ref:
                            d = torch.addmm(z, h_ref[r0:r1].to(cd) * -s_r, ref_head.weight[v0:v1].to(cd).t())  # z - r
                            if ref_head.bias is not None:
                                d.sub_(ref_head.bias[v0:v1].to(cd) * s_r)
                        else:
                            d = _tile(h_ref[r0:r1], ref_head, v0, v1, cd, acc)
                            d = torch.sub(z, d, out=d)
                        d = torch.addcmul(c[rows], d, k_k[rows], out=d)  # k_k (z - r) + c, in place
                        if g_e is not None:
                            d.addcmul_(z, k_e[rows], value=-1)
                    ga = z.sub_(m[rows].unsqueeze(-1)).exp_().mul_(d)  # exp(z - m) d = p (the brackets)
                    if not (isinstance(dz, float) and dz == 1):
                        ga.mul_(dz)
                    if g_l is not None:  # + g_l e_y, where y is in this tile
                        ga.scatter_add_(-1, col, one)
                    _accumulate(ga, x, head, v0, v1, r0, r1, gh, gw, gb, cd)
        out = [None if gh is None else gh.to(h.dtype), None if gw is None else gw.to(head.weight.dtype),
               None if gb is None else gb.to(head.bias.dtype)]
        return (*out,) + (None,) * 10


def _accumulate(ga, x, head, v0, v1, r0, r1, gh, gw, gb, cd) -> None:
    """Adds one tile's gradient ga [r, vb] of the head's raw output to the hidden states', weight's and bias's."""
    g = ga.to(cd)
    if gh is not None:
        gh[r0:r1] += (g @ head.weight[v0:v1].to(cd)).to(gh.dtype)  # [r, H]
    if gw is not None:
        gw[v0:v1] += (g.transpose(0, 1) @ x.to(cd)).to(gw.dtype)  # [vb, H]
    if gb is not None:
        gb[v0:v1] += ga.sum(0)


def head_scores(h: torch.Tensor, head: LMHead, tokens: torch.Tensor, h_ref: torch.Tensor, ref_head: LMHead,
                with_token_kl: bool = False, with_entropy: bool = True, ref_norm: tuple | None = None) -> Scores:
    """The per-position scores of N rows: h [N, H] the policy's final hidden states (differentiable, as are
    head.weight and head.bias), h_ref [N, H_ref] the reference's (frozen), tokens [N] the scored tokens.

    with_token_kl: also kappa, the exact KL(pi || pi_ref) per row (one more head product of the reference in forward,
    and in backward where its gradient is used); with_entropy: the entropy per row; both differentiable. ref_norm:
    the reference's (m_r, log s_r) [N] each, from its log-probs' pass (head_logprob); then Scores.ref_logp is None.
    """
    if h.dim() != 2 or h_ref.dim() != 2 or tokens.shape != h.shape[:1] or h_ref.shape[0] != h.shape[0]:
        raise ValueError(f"head_scores: h [N, H], h_ref [N, H_ref] and tokens [N] must agree; got {tuple(h.shape)}, "
                         f"{tuple(h_ref.shape)}, {tuple(tokens.shape)}")
    if head.weight.shape[0] != ref_head.weight.shape[0]:
        raise ValueError(f"head_scores: the policy's head has {head.weight.shape[0]} tokens and the reference's "
                         f"{ref_head.weight.shape[0]}: their vocabularies must match")
    cd = product_dtype(h, head)  # one dtype for both models' products: pi = pi_ref gives kappa = 0 exactly
    ref_logp = None
    if ref_norm is None:
        ref_logp, ref_norm = head_logprob(h_ref, ref_head, tokens, cd)
    logp, k, ent = _HeadScores.apply(
        h, head.weight, head.bias, h_ref.detach(), ref_head.weight.detach(),
        None if ref_head.bias is None else ref_head.bias.detach(), tokens, head, ref_head, with_token_kl,
        ref_norm[0].detach(), ref_norm[1].detach(), cd)
    return Scores(logp, ref_logp, k if with_token_kl else None, ent if with_entropy else None)


@torch.no_grad()
def head_logprob(h: torch.Tensor, head: LMHead, tokens: torch.Tensor,
                 cd: torch.dtype | None = None) -> tuple[torch.Tensor, tuple]:
    """([N] log pi(y), (m, log s) [N] each: the normaliser head_scores takes as ref_norm) of one model, without
    gradient (a step's reference pass), the vocabulary reduced a tile at a time. h: [N, H]; tokens: [N]; cd: the
    product's dtype (None: product_dtype(h, head), read here, before autocast is turned off for the tiles)."""
    cd = product_dtype(h, head) if cd is None else cd
    with torch.autocast(h.device.type, enabled=False):
        m, ls, zy, _, _ = _reduce(h, head, tokens, cd, _acc(h.dtype), offsets=False)
    return (zy - m) - ls, (m, ls)
