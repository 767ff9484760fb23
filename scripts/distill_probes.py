"""The two diagnostics behind the distillation conclusion in docs/distillation.md (not part of the package).

    python scripts/distill_probes.py tabular-exact [--sgd] [--lr 0.1 0.03]
        Noise-free: Adam (or SGD) on the EXACT sequence-KL gradient versus the EXACT token-level partial
        gradient, on experiment=distill_estimators_tabular's student and teacher tables.
    python scripts/distill_probes.py lm-gradients [--batches 48]
        At the starting student of experiment=distill_estimators: each estimator's KL gradient on the same
        batches of 32 samples; how well their means agree, and the per-batch signal-to-noise ratio.
"""
from __future__ import annotations

import argparse
import sys

import torch


def experiment_config(experiment: str):
    from klbench.config.compose import compose
    return compose([f"experiment={experiment}"])


def tabular_exact(lrs: list[float], sgd: bool, steps: int = 100) -> None:
    from klbench.exact.tabular import TabularModel
    cfg = experiment_config("distill_estimators_tabular")
    m, t = cfg.model, cfg.teacher
    teacher = TabularModel(m.K, m.T, eos=m.eos, seed=t.ref_seed, ref_scale=t.ref_scale)
    start = TabularModel(m.K, m.T, eos=m.eos, seed=m.ref_seed, ref_scale=m.ref_scale).ref_logits  # [P, K]

    def token_partial(theta: torch.Tensor) -> torch.Tensor:
        # sum_p sg(reach(p)) KL(pi(.|p) || teacher(.|p)): its gradient is what `token` estimates
        reach = teacher.reach(theta.detach())  # [P]
        lp, lq = torch.log_softmax(theta, -1), torch.log_softmax(teacher.ref_logits, -1)  # [P, K]
        return (reach * (lp.exp() * (lp - lq)).sum(-1)).sum()

    print(f"exact KL(student || teacher) every 10 steps, {'SGD' if sgd else 'Adam'}, K={m.K} T={m.T}")
    for lr in lrs:
        for name, loss in (("sequence", teacher.kl_pi_ref), ("token", token_partial)):
            theta = start.clone().requires_grad_(True)
            opt = (torch.optim.SGD if sgd else torch.optim.Adam)([theta], lr=lr)
            kls = []
            for step in range(steps + 1):
                if step % 10 == 0:
                    kls.append(float(teacher.kl_pi_ref(theta.detach())))
                opt.zero_grad()
                loss(theta).backward()
                opt.step()
            print(f"lr {lr:<6g} {name:>8}: " + " ".join(f"{v:5.2f}" for v in kls))


def lm_gradients(n_batches: int) -> None:
    from klbench.data.prompts import load_prompts
    from klbench.estimators import gradient_estimator
    from klbench.models.policies import build_policy
    torch.manual_seed(0)
    cfg = experiment_config("distill_estimators")
    t = cfg.task
    policy = build_policy(cfg.model, t.max_new_tokens, cfg.paths.cache, cfg.teacher)
    prompts, _ = load_prompts(cfg.dataset)
    names = ("token", "seq", "cumulative", "loo", "rb")
    params = policy.trainable()
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for b in range(n_batches):
        batch_prompts = [prompts[(b * t.prompts_per_step + i) % len(prompts)] for i in range(t.prompts_per_step)]
        ro = policy.rollout(batch_prompts, t.n_samples)  # one training step's samples, shared by all estimators
        for n in names:
            g = torch.autograd.grad(gradient_estimator(n)(policy.score(ro)).mean(), params)
            grads[n].append(torch.cat([x.flatten() for x in g]))
    G = {n: torch.stack(v) for n, v in grads.items()}  # [n_batches, n_params]
    mean = {n: g.mean(0) for n, g in G.items()}  # [n_params]
    pooled = torch.stack([mean[n] for n in names[1:]]).mean(0)  # the unbiased estimators share one expectation

    def cos(a, b):
        return float(a @ b / (a.norm() * b.norm()))

    print(f"{n_batches} batches of {t.prompts_per_step} prompts x {t.n_samples} samples, {t.max_new_tokens} new tokens")
    print(f"{'estimator':>10} {'|mean|':>8} {'cos(mean, unbiased mean)':>25} {'per-batch SNR':>14} "
          f"{'cos(batch, rb mean)':>20}")
    for n in names:
        noise = ((G[n] - mean[n]) ** 2).sum(1).mean()  # E|g - mean|^2
        batch_cos = sum(cos(g, mean["rb"]) for g in G[n]) / n_batches
        print(f"{n:>10} {float(mean[n].norm()):8.1f} {cos(mean[n], pooled):25.3f} "
              f"{float(mean[n].norm() ** 2 / noise):14.4f} {batch_cos:20.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    tab = sub.add_parser("tabular-exact")
    tab.add_argument("--lr", type=float, nargs="+", default=[0.1, 0.03])
    tab.add_argument("--sgd", action="store_true")
    lm = sub.add_parser("lm-gradients")
    lm.add_argument("--batches", type=int, default=48)
    args = p.parse_args(argv)
    if args.what == "tabular-exact":
        tabular_exact(args.lr, args.sgd)
    else:
        lm_gradients(args.batches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
