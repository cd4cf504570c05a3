"""A request in flight: its attempts, the merge of their tokens by index, and recovery from lost tiers."""
