"""Private helpers every layer above may use: atomic files on any fsspec filesystem (:mod:`.fs`) and
the redaction of credentials in URLs, messages and data (:mod:`.secrets`). Not public API."""
