"""The PPO/GRPO trainer: the loop, the actor (loss, update), advantages, data, checkpoints,
evaluation and what a run writes."""
