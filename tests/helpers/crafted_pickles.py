"""A crafted pickle for the checkpoint-safety tests: an object that, unpickled, runs code
(it creates a marker file, as any code could run instead)."""

import io

OPEN = f"{io.open.__module__}.{io.open.__qualname__}"
"""How a pickle names ``io.open`` (``_io.open`` on Python 3.12)."""


class Opens:
    """Unpickled, it creates the file ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))
