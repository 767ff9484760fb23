"""The exact bias of the KL estimators against the temperature, per KL target, on the tabular model
(docs/sampling.md): the tables it quotes and docs/img/sampling_bias.png.

    python scripts/sampling_bias.py                                   # tables, T in TABLE_TEMPERATURES
    python scripts/sampling_bias.py --plot docs/img/sampling_bias.png # and the figure (T from 0.3 to 2)

Everything is enumerated (klbench.exact.tabular: samples from pi_s, batches from target_batch, the target's exact
KL and gradient), on the audit's three default instances; a figure's curve is the mean over the three.
Relative gradient bias: |E[g] - grad KL| / |grad KL| of the estimators of grad KL(p || q) for the target's pair
(p, q); value bias: (E[v] - KL) / KL. The tinker-cookbook #689 pairing (tempered_vs_raw) is measured by what it
does with no reward at all: the KL it reports at pi = pi_ref, and KL(pi || pi_ref) at its own minimiser,
theta = T x pi_ref's logits (pi_T = pi_ref), where its gradient is zero.
"""
from __future__ import annotations

import argparse

import torch

from klbench.estimators import gradient_estimator, value_estimator
from klbench.estimators.sampling import Sampling
from klbench.exact.tabular import default_instances

GRADIENTS = {"seq": ("seq", {}, 1), "loo": ("loo", {}, 2), "rb": ("rb", {}, 1)}
VALUES = {"mc (k1)": ("mc", {}), "k3": ("cv", {}), "rb": ("rb", {})}
TABLE_TEMPERATURES = (0.5, 0.7, 1.0, 1.5)
TRUNCATION = {"top_p": 0.9}  # the figure's truncation (a typical instruct model's generation_config)


def biases(sampling: Sampling, target: str) -> dict[str, float]:
    """Mean over the default instances of each estimator's relative bias for `target` under `sampling`."""
    out: dict[str, list[float]] = {}
    for model, theta in default_instances():
        g = model.exact_gradients(theta, sampling=sampling, target=target)["kl_pi_ref"]
        for lab, (name, opts, n) in GRADIENTS.items():
            mean = model.gradient_moments(gradient_estimator(name, **opts), theta, n=n, sampling=sampling,
                                          target=target).mean
            out.setdefault(f"grad {lab}", []).append(float((mean - g).norm() / g.norm()))
        kl = float(model.target_kl(theta, sampling, target))
        for lab, (name, opts) in VALUES.items():
            v = float(model.value_moments(value_estimator(name, **opts), theta, sampling=sampling, target=target).mean)
            out.setdefault(f"value {lab}", []).append((v - kl) / kl)
    return {k: sum(v) / len(v) for k, v in out.items()}


def tinker_cost(t: float) -> tuple[float, float]:
    """(KL(pi_T || pi_ref) at pi = pi_ref, KL(pi || pi_ref) at the pairing's minimiser), means over instances."""
    s, at_ref, drift = Sampling(temperature=t), [], []
    for model, _ in default_instances():
        at_ref.append(float(model.target_kl(model.ref_logits, s, "tempered_vs_raw")))
        drift.append(float(model.kl_pi_ref(t * model.ref_logits)))
    return sum(at_ref) / len(at_ref), sum(drift) / len(drift)


def model_target_cost(t: float) -> tuple[float, float]:
    """target=model at temperature t: tr Cov of rb's gradient and the variance of rb's value (both importance-
    weighted by the prefixes' ratios pi / pi_T), as ratios to their on-policy values at T = 1; means over
    instances."""
    s, grad, val = Sampling(temperature=t), [], []
    for model, theta in default_instances():
        est_g, est_v = gradient_estimator("rb"), value_estimator("rb")
        grad.append(model.gradient_moments(est_g, theta, sampling=s, target="model").trace
                    / model.gradient_moments(est_g, theta).trace)
        val.append(model.value_moments(est_v, theta, sampling=s, target="model").trace
                   / model.value_moments(est_v, theta).trace)
    return sum(grad) / len(grad), sum(val) / len(val)


def tables() -> None:
    print(f"relative bias, mean over the 3 default instances, truncation {TRUNCATION}:")
    for target in ("sampler", "tempered", "tempered_vs_raw"):
        for t in TABLE_TEMPERATURES:
            s = Sampling(temperature=t, **TRUNCATION)
            row = biases(s, target)
            print(f"| {target} | {s.describe()} | " + " | ".join(f"{v:+.3f}" for v in row.values()) + " |")
    print("columns: " + " | ".join(biases(Sampling(0.7), "sampler")))
    print("\ntinker pairing without reward: "
          "| T | KL(pi_T || pi_ref) at pi = pi_ref | KL(pi || pi_ref) at its minimum |")
    for t in TABLE_TEMPERATURES:
        a, b = tinker_cost(t)
        print(f"| {t:g} | {a:.4f} | {b:.4f} |")
    print("\ntarget=model, rb with prefix importance weights: "
          "| T | tr Cov(grad) / on-policy | Var(value) / on-policy |")
    for t in TABLE_TEMPERATURES:
        a, b = model_target_cost(t)
        print(f"| {t:g} | {a:.3f} | {b:.3f} |")


def plot(path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    temps = [round(0.3 + 0.05 * i, 2) for i in range(35)]  # 0.3 .. 2.0
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for target, style in (("sampler", ":"), ("tempered", "-"), ("tempered_vs_raw", "--")):
        rows = [biases(Sampling(temperature=t, **TRUNCATION), target) for t in temps]
        for i, lab in enumerate(VALUES):
            axes[0].plot(temps, [r[f"value {lab}"] for r in rows], style, color=f"C{i}", label=f"{lab}, {target}")
        for i, lab in enumerate(GRADIENTS):
            axes[1].plot(temps, [r[f"grad {lab}"] for r in rows], style, color=f"C{i}", label=f"{lab}, {target}")
    axes[0].set(title=f"value bias (E[v] - KL) / KL, top_p={TRUNCATION['top_p']}", xlabel="temperature T")
    axes[1].set(title=f"gradient bias |E[g] - grad KL| / |grad KL|, top_p={TRUNCATION['top_p']}",
                xlabel="temperature T")
    cost = [tinker_cost(t) for t in temps]
    axes[2].plot(temps, [c[0] for c in cost], color="C3", label="KL(pi_T || pi_ref) reported at pi = pi_ref")
    axes[2].plot(temps, [c[1] for c in cost], color="C4", label="KL(pi || pi_ref) where its penalty is 0")
    axes[2].set(title="tempered_vs_raw (tinker #689): T alone, no reward", xlabel="temperature T",
                ylabel="nats")
    for ax in axes:
        ax.axvline(1.0, color="grey", lw=0.5)
        ax.legend(fontsize=6)
    fig.suptitle("Exact, tabular (mean of the audit's 3 instances); sampler target: dotted, exactly 0", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", metavar="PNG", help="also draw the figure into this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tables()
    if args.plot:
        plot(args.plot)


if __name__ == "__main__":
    main()
