"""API keys: which requests the server answers.

With keys configured, every endpoint but ``/health`` (and ``/metrics`` when it is made
public) needs ``Authorization: Bearer <key>``; anything else gets OpenAI's 401. Each key
is a tenant: its requests read and write the KV cache under their own salt. Keys are
kept only as SHA-256 digests and compared in constant time, so neither a repr, a log line
nor the time a refusal takes tells anything about them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

TENANT_STATE = "kvboost_tenant"
"""Where the middleware leaves the caller's tenant in the request state."""

API_KEY_ENV = "KVBOOST_API_KEY"
"""Environment variable with the server's key (several: separated by commas)."""


class ApiKeys:
    """The keys a server accepts; none configured: every request is accepted.

    >>> keys = ApiKeys(["k-123"])
    >>> keys.accepts("Bearer k-123"), keys.accepts("Bearer k-124"), keys.accepts(None)
    (True, False, False)
    >>> keys
    ApiKeys(1 key)
    """

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests = [_digest(key) for key in dict.fromkeys(k.strip() for k in keys) if key]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __repr__(self) -> str:
        n = len(self._digests)
        return f"ApiKeys({n} key{'' if n == 1 else 's'})"

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries one of the keys (always, with none set)."""
        return not self._digests or self.tenant(authorization) is not None

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of the key an ``Authorization`` header carries (a digest of it), or None."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        offered = _digest(token.strip())
        found = None
        for digest in self._digests:  # no early exit: the time taken does not say which key matched
            if hmac.compare_digest(digest, offered):
                found = digest
        if found is None or scheme.lower() != "bearer":
            return None
        return "key-" + found.hex()[:32]

    @classmethod
    def gather(
        cls,
        keys: Sequence[str] = (),
        keys_file: str | Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ApiKeys:
        """Keys from the arguments, a file (one per line; blank lines and ``#`` comments skipped)
        and :data:`API_KEY_ENV`.

        >>> ApiKeys.gather(["a"], env={"KVBOOST_API_KEY": "b, c"})
        ApiKeys(3 keys)
        """
        found = list(keys)
        if keys_file is not None:
            try:
                lines = Path(keys_file).expanduser().read_text(encoding="utf-8").splitlines()
            except OSError as e:
                raise ValueError(f"cannot read the API keys file {keys_file}: {e.strerror or e}") from e
            found += [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
        environ = os.environ if env is None else env
        found += environ.get(API_KEY_ENV, "").split(",")
        return cls(found)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
