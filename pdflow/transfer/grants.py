"""A consumer instance's pairing key: the token a producer pairs with, and the nonce
that grants a transfer into given blocks.

The consumer's owner gives its ranks one key (``OpenKVLink``); their endpoints publish
only ``pairing_token(key)``, which a producer rank's hello must present. Each request's
transfer must carry ``kv_nonce(key, blocks)``, which only the owner can make (it hands it
out with the blocks: ``KVTarget``). Stateless: a paired producer's replay of an earlier
grant of the same blocks passes (the owner holds them until that transfer settles).
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
