"""The policy model: its architecture (:mod:`.args`), the Megatron-Core builder
(:mod:`.build`), its command-line settings (:mod:`.config`) and the shared forward passes
(:mod:`.forward`)."""

from loggra_megatron.model.args import GPTModelArgs, pad_vocab_size

__all__ = ["GPTModelArgs", "pad_vocab_size"]
