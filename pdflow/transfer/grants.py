"""A consumer instance's pairing key: the token a producer pairs with, and the nonce
that grants a transfer into given blocks.

The consumer's owner draws one key (``new_key``) and gives it to its ranks
(``OpenKVLink``); its endpoints publish only ``pairing_token(key)``, which reaches the
producers it pairs with (through the owner in process, ``/pdflow/pair`` between
instances). A producer rank's hello must present that token, and each request's
transfer must carry ``kv_nonce(key, blocks)``, which only the consumer's owner can make:
it hands the nonce out with the blocks it allocated (``KVTarget``). A consumer rank
recomputes it before it scatters a byte, so a peer that never paired cannot pair, and a
transfer into blocks the owner did not grant is refused. The check is stateless: it
cannot tell a paired producer's replay of an earlier grant of the same blocks (the owner
holds a request's blocks until its transfer settles, so no other request has them).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

KEY_BYTES = 32


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def pairing_token(key: bytes) -> str:
    """What a consumer rank's endpoint publishes and a producer's hello must present."""
    return hmac.new(key, b"pdflow-pairing", hashlib.sha256).hexdigest()


def kv_nonce(key: bytes, blocks: Sequence[int]) -> int:
    """The nonce granting a transfer into ``blocks`` (in order): 63 bits of an HMAC."""
    message = b"pdflow-kv:" + ",".join(str(int(b)) for b in blocks).encode()
    return int.from_bytes(hmac.new(key, message, hashlib.sha256).digest()[:8], "big") >> 1


def token_matches(key: bytes, token: str) -> bool:
    return hmac.compare_digest(pairing_token(key).encode(), token.encode())


def nonce_matches(key: bytes, blocks: Sequence[int], nonce: int) -> bool:
    if not 0 <= nonce < 1 << 63:
        return False
    return hmac.compare_digest(kv_nonce(key, blocks).to_bytes(8, "big"), nonce.to_bytes(8, "big"))
