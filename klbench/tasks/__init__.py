"""LightningModules and task runners: rl, distill, pretrain."""
