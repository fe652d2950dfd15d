"""The static engine's decoders a block makes, recorded for the tests."""

import contextlib


@contextlib.contextmanager
def recorded_decoders():
    """A list of every ``StaticDecoder`` made inside the block, by ``generate_rollout`` or by
    a chunked rollout (both names it is made through are patched, and restored after)."""
    from loggra_megatron.rollout.static import decoder, generate

    made, saved = [], decoder.StaticDecoder

    class Recording(saved):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    decoder.StaticDecoder = generate.StaticDecoder = Recording
    try:
        yield made
    finally:
        decoder.StaticDecoder = generate.StaticDecoder = saved
