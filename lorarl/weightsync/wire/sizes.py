"""The sizes a payload is cut and kept by, apart from the code that packs it (which needs torch): the `--dry-run`
plan sizes the services' memory by them without importing torch into the launcher."""

#: A bucket of a payload: what a collective broadcast or an inline transfer moves at a time.
DEFAULT_BUCKET_BYTES = 1 << 30
#: A merged payload up to this size is packed once and kept for sending; a bigger one is packed again while sent.
MATERIALIZE_LIMIT_BYTES = 2 << 30
