"""Everything that reads Megatron-Core optimizer internals (pinned, covered by tests)."""
