"""One step's backward, a micro-batch at a time, with the gradient of the whole batch's loss.

    batch, loss, info = backward_in_parts(policy, scoring, loss_fn)

`loss_fn(batch) -> (loss, info)` is the step's loss on a whole batch, written once (klbench/tasks/rl.py). Each
micro-batch of `scoring` (klbench.models.scoring) is scored with gradient, spliced into the whole batch (its rows
live, every other row a detached stand-in), and loss_fn of that batch is backpropagated at once: the graph of one
micro-batch is alive at a time, and each sequence gets one forward of the policy with gradient. Whatever loss_fn
reads across sequences is detached (every estimator's baselines, group statistics, token counts: checked by
tests/test_micro_batch.py), so the other rows add no gradient, and the parts' gradients sum to the whole batch's.

Lightning then backpropagates the returned loss as it would any step's: its value is loss_fn of the whole batch
(every row's scores, detached), and its gradient, through a carrier, is the sum the parts left. Lightning's
clipping, its precision plugin and DDP's gradient reduction (armed by the DDP forward only after training_step
returns, so the parts' own backward passes reduce nothing) see one ordinary backward.
"""
from __future__ import annotations

import torch


class _Carry(torch.autograd.Function):
    """A scalar whose gradient with respect to `params` is `grads` (given up to autograd: not copied)."""

    @staticmethod
    def forward(ctx, value, grads, *params):
        ctx.grads = grads
        return value.detach().clone()

    @staticmethod
    def backward(ctx, g):
        grads, ctx.grads = ctx.grads, None
        scale = None if bool(g == 1) else g
        return (None, None, *(None if x is None else x if scale is None else x * scale.to(x.dtype) for x in grads))


def backward_in_parts(policy, scoring, loss_fn):
    """(the whole batch, detached; the loss to return from training_step; loss_fn's info on the whole batch)."""
    params = list(policy.trainable())
    for p in params:  # the previous step's gradient: Lightning zeroes it only after training_step
        p.grad = None
    for i, j, part in scoring.parts():
        loss, _ = loss_fn(scoring.splice(part, i, j))
        loss.backward()
    whole = scoring.whole()
    with torch.no_grad():
        value, info = loss_fn(whole)
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return whole, _Carry.apply(value, grads, *params), info
