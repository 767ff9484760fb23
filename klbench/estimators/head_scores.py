"""Per-position scores straight from final hidden states and LM heads, in tiles: no [N, V] logits, ever.

A language model's next-token logits are z = softcap(scale * (h W^T + b)) / T (`LMHead`: weight, bias, a logit
scale, Gemma's final-logit softcapping, the KL target's temperature). Everything an estimator but top-k reads from
them is a per-position reduction over the vocabulary:

    log pi(y_t)        z_y - lse(z)
    log pi_ref(y_t)    r_y - lse(r)                        r the reference's logits
    kappa_t            sum_v p_v (log p_v - log q_v)        the exact KL(pi || pi_ref) at position t (rb's)
    H_t                -sum_v p_v log p_v                   the entropy

`head_scores` computes them a tile of rows x vocabulary at a time, with a running maximum over the vocabulary
(one pass, as an online softmax), and its backward recomputes each tile and writes the gradient of the hidden
states and of the head (weight, bias) tile by tile. No more than one tile's working set of [rows, V-chunk]
float32 is alive, whatever the vocabulary: NeMo-RL's exact-KL distillation loss and a fused linear cross-entropy
do the same for one model; here the reference's logits are recomputed from its hidden states beside the
policy's, so the full-vocabulary KL costs what the log-probs cost, plus one head product of the reference.

Gradients (per row; g_l, g_k, g_e the upstream gradients of log pi(y), kappa and H):

    d/dz = g_l (e_y - p) + g_k p (z - r - s) - g_e p (z - lse + H),   s = lse - lse_r + kappa
         = p (g_k (z - r) - g_e z - c) + g_l e_y,                      c = g_l + g_k s - g_e (lse - H)

then through the temperature, the softcap (1 - (u / cap)^2) and the scale to the head's input. The one-hot part
is added per row from W[y], outside the tiles. Matrix products run in the dtype autocast would use (bf16 under
bf16-mixed), the softmax arithmetic in float32 (float64 stays, for the exact tests).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class LMHead:
    """z = softcap(scale * (h @ weight.T + bias)) / temperature; softcap(x) = cap * tanh(x / cap), none if None."""

    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None = None  # [V]
    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    def at(self, temperature: float) -> "LMHead":
        return replace(self, temperature=float(temperature))

    def post(self, a: torch.Tensor) -> torch.Tensor:
        """The logits from the head's raw output a = h W^T + b (any shape): what a model's forward does after
        its output embedding, then the temperature."""
        z = a * self.scale if self.scale != 1 else a
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z / self.temperature if self.temperature != 1 else z

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., V] the unfused logits (tests and the logits path), in h's dtype."""
        return self.post(torch.nn.functional.linear(h, self.weight, self.bias))


@dataclass
class Scores:
    """[N] each, float32 (float64 stays): the per-position quantities of N rows; None where not asked for."""

    logp: torch.Tensor
    ref_logp: torch.Tensor | None = None
    kappa: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def tile_shape(rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(rows, vocabulary columns) of one tile: about 2^22 float32 elements (16 MiB) on CPU, where a [V-chunk, H] slice
    of the head stays in cache across the row block; 2^26 on accelerators, to amortise kernel launches."""
    budget, cols = (2 ** 22, 8192) if device.type == "cpu" else (2 ** 26, 32768)
    cols = min(vocab, cols)
    return max(1, min(rows, budget // cols)), cols


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype of the head's matrix product: autocast's where it is on (as the model's own head would run)."""
    kind = h.device.type
    if h.dtype != torch.float64 and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return h.dtype


def _tile(h: torch.Tensor, head: LMHead, v0: int, v1: int, cd: torch.dtype, acc: torch.dtype) -> torch.Tensor:
    """[r, v1 - v0] logits of one tile, in acc."""
    b = None if head.bias is None else head.bias[v0:v1].to(cd)
    return head.post(torch.nn.functional.linear(h.to(cd), head.weight[v0:v1].to(cd), b).to(acc))


def _at_tokens(h: torch.Tensor, head: LMHead, tokens: torch.Tensor, cd: torch.dtype, acc: torch.dtype):
    """([r] raw head output a_y, [r] logit z_y) at each row's token: a row-wise dot product with W[y]."""
    a = (h.to(cd) * head.weight[tokens].to(cd)).sum(-1)
    if head.bias is not None:
        a = a + head.bias[tokens].to(cd)
    a = a.to(acc)
    return a, head.post(a)


def _dz_da(z: torch.Tensor, head: LMHead) -> torch.Tensor | float:
    """dz/da elementwise: scale / T, times 1 - tanh^2 under the softcap (tanh = z T / cap)."""
    k = head.scale / head.temperature
    if not head.softcap:
        return k
    t = z * (head.temperature / head.softcap)
    return (1 - t * t) * k


class _HeadScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, h_ref, ref_weight, ref_bias, tokens, head, ref_head, want_kappa, ref_lse, cd):
        ctx.cd = cd
        acc = _acc(h.dtype)
        N, V = h.shape[0], head.weight.shape[0]
        rb, vb = tile_shape(N, V, h.device)
        with torch.autocast(h.device.type, enabled=False):
            lse = torch.empty(N, dtype=acc, device=h.device)
            lse_r = torch.empty_like(lse) if ref_lse is None else ref_lse.to(acc)
            kappa = torch.empty_like(lse) if want_kappa else None
            mean_z = torch.empty_like(lse)  # sum_v p_v z_v: the entropy, and the entropy's gradient
            need_ref = want_kappa or ref_lse is None
            for r0 in range(0, N, rb):
                r1 = min(N, r0 + rb)
                x, xr = h[r0:r1], h_ref[r0:r1]
                m = torch.full((r1 - r0,), -torch.inf, dtype=acc, device=h.device)  # running max of z
                s, sz, sk = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
                mr, sr = m.clone(), torch.zeros_like(m)
                for v0 in range(0, V, vb):
                    v1 = min(V, v0 + vb)
                    z = _tile(x, head, v0, v1, cd, acc)  # [r, vb]
                    m_new = torch.maximum(m, z.amax(-1))
                    alpha = torch.exp(m - m_new)  # [r]: rescales what was summed under the old maximum
                    e = torch.exp(z - m_new.unsqueeze(-1))  # [r, vb]
                    s = s * alpha + e.sum(-1)
                    sz = sz * alpha + (e * z).sum(-1)
                    if need_ref:
                        zr = _tile(xr, ref_head, v0, v1, cd, acc)  # [r, vb]
                        if want_kappa:
                            sk = sk * alpha + e.mul_(z - zr).sum(-1)
                        if ref_lse is None:
                            mr_new = torch.maximum(mr, zr.amax(-1))
                            sr = sr * torch.exp(mr - mr_new) + torch.exp(zr - mr_new.unsqueeze(-1)).sum(-1)
                            mr = mr_new
                    m = m_new
                lse[r0:r1] = m + torch.log(s)
                mean_z[r0:r1] = sz / s
                if ref_lse is None:
                    lse_r[r0:r1] = mr + torch.log(sr)
                if want_kappa:
                    kappa[r0:r1] = sk / s - lse[r0:r1] + lse_r[r0:r1]
            _, zy = _at_tokens(h, head, tokens, cd, acc)
            _, ry = _at_tokens(h_ref, ref_head, tokens, cd, acc)
        logp, ref_logp = zy - lse, ry - lse_r
        entropy = lse - mean_z
        ctx.save_for_backward(h, h_ref, tokens, lse, lse_r, mean_z, zy, kappa if want_kappa else lse)
        ctx.heads, ctx.want_kappa = (head, ref_head), want_kappa
        ctx.set_materialize_grads(False)
        return logp, ref_logp, kappa if want_kappa else torch.zeros_like(lse), entropy

    @staticmethod
    def backward(ctx, g_l, g_r, g_k, g_e):
        h, h_ref, tokens, lse, lse_r, mean_z, zy, kappa = ctx.saved_tensors
        head, ref_head = ctx.heads
        if not ctx.want_kappa:
            g_k = None
        grads_of = ctx.needs_input_grad[:3]
        if (g_l is None and g_k is None and g_e is None) or not any(grads_of):
            return (None,) * 12
        acc, cd = lse.dtype, ctx.cd
        N, V = h.shape[0], head.weight.shape[0]
        rb, vb = tile_shape(N, V, h.device)
        zero = torch.zeros_like(lse)
        g_l, g_k, g_e = (zero if g is None else g.to(acc) for g in (g_l, g_k, g_e))
        # the per-row constant c; g_k and g_e multiply whole tiles only where they are given
        c = g_l - g_e * mean_z + (g_k * (lse - lse_r + kappa) if ctx.want_kappa else 0)
        use_k, use_e = ctx.want_kappa and bool(g_k.any()), bool(g_e.any())
        with torch.autocast(h.device.type, enabled=False):
            gh = torch.zeros(h.shape, dtype=acc, device=h.device) if grads_of[0] else None  # [N, H]
            gw = torch.zeros(head.weight.shape, dtype=acc, device=h.device) if grads_of[1] else None  # [V, H]
            gb = torch.zeros(V, dtype=acc, device=h.device) if grads_of[2] else None  # [V]
            for r0 in range(0, N, rb):
                r1 = min(N, r0 + rb)
                x = h[r0:r1]
                for v0 in range(0, V, vb):
                    v1 = min(V, v0 + vb)
                    z = _tile(x, head, v0, v1, cd, acc)  # [r, vb]
                    p = torch.exp(z - lse[r0:r1].unsqueeze(-1))  # [r, vb]
                    d = -c[r0:r1].unsqueeze(-1)  # [r, 1] -> [r, vb] below
                    if use_k:
                        d = (z - _tile(h_ref[r0:r1], ref_head, v0, v1, cd, acc)).mul_(g_k[r0:r1].unsqueeze(-1)) + d
                    if use_e:
                        d = d - z * g_e[r0:r1].unsqueeze(-1)
                    ga = p.mul_(d).mul_(_dz_da(z, head))  # [r, vb]: the gradient of the head's raw output
                    _accumulate(ga, x, head, v0, v1, r0, r1, gh, gw, gb, cd)
            # the one-hot part of d log pi(y) / dz, g_l e_y, row by row from W[y]
            gy = g_l * _dz_da(zy, head)  # [N]
            if gh is not None:
                gh += gy.unsqueeze(-1) * head.weight[tokens].to(acc)
            if gw is not None:
                gw.index_add_(0, tokens, gy.unsqueeze(-1) * h.to(acc))
            if gb is not None:
                gb.index_add_(0, tokens, gy)
        out = [None if gh is None else gh.to(h.dtype), None if gw is None else gw.to(head.weight.dtype),
               None if gb is None else gb.to(head.bias.dtype)]
        return (*out,) + (None,) * 9


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
                kappa: bool = False, entropy: bool = True, ref_lse: torch.Tensor | None = None) -> Scores:
    """The per-position scores of N rows: h [N, H] the policy's final hidden states (differentiable, as are
    head.weight and head.bias), h_ref [N, H_ref] the reference's (frozen), tokens [N] the scored tokens.

    kappa: also the exact KL(pi || pi_ref) per row, differentiable (one more head product of the reference in
    forward and in backward). entropy: the policy's entropy per row, differentiable. ref_lse [N]: the reference's
    log-normaliser where the caller has it (the reference pass of a step computes it once); None: computed here.
    """
    if h.dim() != 2 or h_ref.dim() != 2 or tokens.shape != h.shape[:1] or h_ref.shape[0] != h.shape[0]:
        raise ValueError(f"head_scores: h [N, H], h_ref [N, H_ref] and tokens [N] must agree; got {tuple(h.shape)}, "
                         f"{tuple(h_ref.shape)}, {tuple(tokens.shape)}")
    if head.weight.shape[0] != ref_head.weight.shape[0]:
        raise ValueError(f"head_scores: the policy's head has {head.weight.shape[0]} tokens and the reference's "
                         f"{ref_head.weight.shape[0]}: their vocabularies must match")
    logp, ref_logp, k, ent = _HeadScores.apply(
        h, head.weight, head.bias, h_ref.detach(), ref_head.weight.detach(),
        None if ref_head.bias is None else ref_head.bias.detach(), tokens, head, ref_head, kappa,
        None if ref_lse is None else ref_lse.detach(), _compute_dtype(h))
    return Scores(logp, ref_logp.detach(), k if kappa else None, ent if entropy else None)
