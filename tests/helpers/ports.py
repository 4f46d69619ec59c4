"""A free TCP port on localhost, for jax.distributed's coordinator in the multi-process tests."""

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]
