"""Online data synthesis (Syn-GRPO): a synthesis server, its generator back-ends, its client, and the
trainer-side workflow that swaps synthesised samples into the dataset without ever blocking a step."""
