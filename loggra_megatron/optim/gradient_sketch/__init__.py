"""The gradient sketch (``--loggra-sketch gradient``): Megatron computes each weight's dense
gradient and LoGRA-AdamW keeps Adam's moments in its sketch ``S = G Q`` (``adamw``), with
the bases and their moment transport (``projection``), and on Megatron's data-parallel
shards (``distributed``, ``weight_layout``, ``row_sketch``, ``energy_log``). Torch only; the
Megatron-Core side is ``optim.megatron``."""
