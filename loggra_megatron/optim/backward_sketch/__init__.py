"""The backward sketch (``--loggra-sketch backward``, LoGRA as published): a target's sketch
``S = G Aᵀ`` is summed in the backward pass from its layer's output gradient and projected
input, and no dense gradient of a target exists. ``sketch`` holds the projections and the
Gram-form norms, ``row_adam`` the row optimizer (RowAdam), ``row_updates`` the
``--loggra-row-optimizer`` entries. Torch only; the hooks and the optimizer leaf inside
Megatron-Core are ``optim.megatron.backward_sites`` and ``optim.megatron.backward_optimizer``."""
