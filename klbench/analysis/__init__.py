"""Analyses of the record: Pareto frontiers, distillation curves, their plots and files."""
