"""The exact tabular model and what is computed on it by enumeration, one module per job:

    model.py           TabularModel: enumeration, exact KLs and gradients, the KL targets' tables, estimator moments
    optimum.py         TabularReward, the reward + beta * KL optimum and its Pareto frontier (Frontier, rl_frontier)
    gradient_audit.py  audit / audit_targets: which exact gradient an arbitrary KL loss follows

    from klbench.exact.tabular import TabularModel, audit     # the names below, wherever they live
"""
from klbench.exact.tabular.gradient_audit import (CANDIDATES, OLD_CANDIDATES, AuditReport, AuditRow, Behaviour, audit,
                                                  audit_targets, behaviour_tables, default_instances,
                                                  fixed_length_instances, near_reference_instances)
from klbench.exact.tabular.model import DTYPE, RAW, Moments, RawBatch, Surrogate, TabularModel
from klbench.exact.tabular.optimum import (Frontier, TabularReward, optimal_seq_logprob, pareto_frontier, rl_frontier,
                                           table_from_seq_logprob)

__all__ = ["CANDIDATES", "DTYPE", "OLD_CANDIDATES", "RAW", "AuditReport", "AuditRow", "Behaviour", "Frontier",
           "Moments", "RawBatch", "Surrogate", "TabularModel", "TabularReward", "audit", "audit_targets",
           "behaviour_tables", "default_instances", "fixed_length_instances", "near_reference_instances",
           "optimal_seq_logprob", "pareto_frontier", "rl_frontier", "table_from_seq_logprob"]
