"""The policy model: its architecture (``.args``), the Megatron-Core builder
(``.build``), its command-line settings (``.config``), the shared forward passes
(``.forward``) and the log-probs of given sequences (``.log_probs``)."""

from loggra_megatron.model.args import GPTModelArgs, pad_vocab_size

__all__ = ["GPTModelArgs", "pad_vocab_size"]
