"""Print a pip constraints file that pins the NGC image's own stack (torch, triton,
Transformer Engine, apex, flash-attn, numpy) at the versions installed in it, so that no
later ``pip install`` in docker/Dockerfile replaces them: pip fails instead."""

import importlib.metadata
import re

STACK = re.compile(r"torch|triton|pytorch-triton|transformer-engine.*|apex|flash-attn.*|numpy")


def main() -> None:
    pins = set()
    for dist in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
        if STACK.fullmatch(name):
            pins.add(f"{name}=={dist.version}")
    if not any(pin.startswith("torch==") for pin in pins):
        raise SystemExit("image_stack.py: no torch in this image")
    print("\n".join(sorted(pins)))


if __name__ == "__main__":
    main()
