"""Pure tier machinery: eviction policies, the tier index and the disk block format (no vLLM, no
torch), unit-tested in milliseconds."""
