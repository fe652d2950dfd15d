"""loggra-megatron: LoGRA (low-rank gradient-sketch Adam + predicted-KL step control)
for memory-efficient RL of LLMs on Megatron-Core."""

__version__ = "0.1.0"
