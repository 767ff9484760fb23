"""Why a rollout met non-finite logits, said in the rollout's error (issue 50: NaN or inf weights, a NaN lm_head
entry, or task.temperature=1e-30 ended in a FloatingPointError of 65 to 107 lines, the cause left to guess).
Asked only once the logits are known to be bad, so the scan of the weights costs nothing on a healthy run."""
from __future__ import annotations

import torch


def nonfinite_cause(model, sampling) -> str:
    """'; <the cause>' for the message of a rollout's non-finite logits: the model's weights (naming the tensors
    that hold NaN or inf), else the temperature (the logits / T beyond float32), else the model's forward."""
    with torch.no_grad():
        bad = [name for name, p in model.named_parameters()
               if p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if bad:
        more = f" and {len(bad) - 2} more" if len(bad) > 2 else ""
        return (f"; the model's weights hold NaN or inf ({', '.join(bad[:2])}{more}): the model folder or the "
                "checkpoint is broken, or an earlier run diverged: load weights that are finite")
    t = float(sampling.temperature)
    if t < 1e-3 or t > 1e3:
        return (f"; the weights are finite, and task.temperature={t:g} takes the logits / T out of float32's range "
                "(or every exp(logit / T) to 0 but one): choose a temperature near 1")
    return (f"; the weights are finite and task.temperature={t:g}: the model's forward made them (an overflow in "
            "its activations: try float32, hardware=cpu or hardware=gpu)")
