"""klbench's gradient estimators inside other RL libraries' trainers (docs/integrations.md).

    from klbench.integrations.trl import GRPOTrainer, RLOOTrainer   # TRL 1.16.0, any estimator as the KL term
    from klbench.integrations.verl import ppo_loss                   # verl 0.9.1's actor loss, with klbench's KL

Each module imports its library on import, so importing this package alone imports neither. Nothing in klbench
imports this layer: it sits on top of `klbench.estimators` for users of those libraries.
"""
